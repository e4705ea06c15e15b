"""End to end: output tok/s of the engine vs HF transformers ``generate``, async on and off.

Each workload (requests that all arrive at t=0, random prompts, fixed output lengths) runs
through ``stepscope run``'s own code path (its argument parser, ``EngineConfig``, ``LLM``,
``run_workload``), with default flags (no KV or batching flags: ``max_num_seqs`` sized to the
device, 1024 on an H200; ``--max-num-seqs N`` pins it, e.g. 256 as the issue's first runs) and
``--async on`` / ``--async off``; ``--tuned`` adds the same with the workload's tuned flags (a
large KV cache, a larger token budget). HF ``generate`` runs the same model shape (random weights,
greedy, every output of the full length) at batch ``--hf-batch`` on the workload's first
``--hf-batch`` requests: its tok/s is HF's throughput at that batch.

Rounds alternate every variant ``--rounds`` times in this one process. A timed run repeats the
workload (fresh prompts each time: no prefix-cache hits) until it lasts ``--min-run-s``. Each
engine run builds its engine, warms it up (one run of the workload's shape with 8 output
tokens) and closes it afterwards, so no two engines hold device memory at once; construction and
warm-up are timed apart from the run and reported separately (the first build pays kernel
compilation). HF's model is built, warmed up (one short generate) and freed the same way in each
round, so an engine sizing its KV cache to the device never sees HF's memory in use.

Reported per variant: output tok/s (median over rounds, min..max), TTFT and TPOT p50 (ms, over
every request of the timed runs; HF's TTFT is its first token's time in its batch, TPOT the
mean gap after it), the ratio of the median tok/s to HF's median, and the warm-up seconds.

H200 (the issue's workloads; the 8B shape with ``--with-8b``):
    python bench/bench_e2e.py --device cuda --out bench/results/h200/e2e.json
    python bench/bench_e2e.py --device cuda --workloads 8b-256x128-128 --with-8b \\
        --out bench/results/h200/e2e_8b.json
CPU smoke run (the sample model, tiny workloads, short runs):
    python bench/bench_e2e.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cli import build_parser, config_from_args
from engine.kernels import attention
from engine.llm import LLM, CompletionOutput, outputs_digest
from engine.workload import load_workload


@dataclass(frozen=True)
class Workload:
    """``num_requests`` × (``in_len`` → ``out_len``) on one model shape."""

    name: str
    num_requests: int
    in_len: int
    out_len: int
    model_config: str | None  # a named shape (random weights); None: --model's folder
    tuned: tuple[str, ...] = ()  # the tuned variant's extra `stepscope run` flags


WORKLOADS = {
    w.name: w
    for w in (
        Workload("1024x128-512", 1024, 128, 512, "qwen3-0.6b",
                 ("--num-kv-blocks", "16384", "--max-num-batched-tokens", "8192")),
        Workload("256x128-128", 256, 128, 128, "qwen3-0.6b", ("--num-kv-blocks", "8192")),
        Workload("8b-256x128-128", 256, 128, 128, "qwen3-8b", ("--num-kv-blocks", "8192")),
    )
}  # fmt: skip
DEFAULT_WORKLOADS = "1024x128-512,256x128-128"
QUICK = Workload("quick-8x16-16", 8, 16, 16, None, ("--num-kv-blocks", "256"))


@dataclass
class Variant:
    """One engine configuration (or ``hf``) and its runs."""

    name: str
    engine_flags: tuple[str, ...] | None  # None: HF generate
    runs: list[dict[str, Any]] = field(default_factory=list)
    warmups: list[dict[str, float]] = field(default_factory=list)
    llm: LLM | None = None  # kept between rounds with --keep-engines
    decode_launch: dict[str, Any] | None = None  # replaces attention.DECODE_LAUNCH (an A/B)


# ---- the engine -------------------------------------------------------------------------------
def engine_argv(args: argparse.Namespace, w: Workload, flags: tuple[str, ...]) -> list[str]:
    """``stepscope run`` flags of one engine variant (the workload itself is passed in code)."""
    argv = ["--workload", "synthetic:n=1", "--device", args.device, "--dtype", args.dtype]
    if w.model_config is not None:
        argv += ["--model-config", w.model_config, "--random-weights"]
    else:
        argv += ["--model", args.model]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if args.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(args.max_num_seqs)]
    return argv + list(flags) + args.engine_args


def synthetic(w: Workload, seed: int, out_len: int | None = None, n: int | None = None) -> list:
    spec = (
        f"synthetic:n={n or w.num_requests},in={w.in_len}-{w.in_len},"
        f"out={out_len or w.out_len}-{out_len or w.out_len},vocab={VOCAB},seed={seed}"
    )
    return [dataclasses.replace(r, id=f"s{seed}-{r.id}") for r in load_workload(spec)]


VOCAB = 1000  # prompt token ids below this (every shape's vocab is larger)


def latency_ms(llm: LLM, outputs: list[CompletionOutput]) -> tuple[list[float], list[float]]:
    """TTFT and TPOT (ms) of these requests from the engine's request timeline."""
    timings = llm.engine.requests.timings
    ttft = [v for o in outputs if (v := timings[o.id].ttft_ms) is not None]
    tpot = [v for o in outputs if (v := timings[o.id].tpot_ms) is not None]
    return ttft, tpot


def build_engine(args: argparse.Namespace, w: Workload, v: Variant) -> LLM:
    """The variant's engine, built and warmed up (timed into ``v.warmups``)."""
    assert v.engine_flags is not None
    config = config_from_args(build_parser().parse_args(engine_argv(args, w, v.engine_flags)))
    start = time.perf_counter()
    llm = LLM(config)
    build_s = time.perf_counter() - start
    llm.run_workload(synthetic(w, WARMUP_SEED, out_len=min(8, w.out_len)))
    warmup_s = time.perf_counter() - start - build_s
    v.warmups.append({"build_s": build_s, "warmup_run_s": warmup_s,
                      "max_num_seqs": llm.engine.config.scheduler.max_num_seqs})  # fmt: skip
    return llm


WARMUP_SEED = 1 << 20


def engine_run(
    args: argparse.Namespace, w: Workload, v: Variant, round_: int, expected_tokens: int
) -> None:
    """Time one run of the variant's engine (built and warmed up first unless kept from an
    earlier round); appends to ``v.runs``. Every variant of a round runs the same prompts."""
    if v.decode_launch is None:
        _engine_run(args, w, v, round_, expected_tokens)
        return
    default = attention.DECODE_LAUNCH
    attention.DECODE_LAUNCH = v.decode_launch  # read at every launch and graph capture
    try:
        _engine_run(args, w, v, round_, expected_tokens)
    finally:
        attention.DECODE_LAUNCH = default


def _engine_run(
    args: argparse.Namespace, w: Workload, v: Variant, round_: int, expected_tokens: int
) -> None:
    llm = v.llm if v.llm is not None else build_engine(args, w, v)
    outputs: list[CompletionOutput] = []
    digest = ""
    ttft: list[float] = []
    tpot: list[float] = []
    elapsed = 0.0
    while elapsed < args.min_run_s or not outputs:
        work = synthetic(w, 1000 * (round_ + 1) + len(outputs) // w.num_requests)
        t0 = time.perf_counter()
        outs = llm.run_workload(work)
        elapsed += time.perf_counter() - t0
        digest = digest or outputs_digest(outs)  # the round's first repeat: same in every variant
        got = sum(len(o.output_token_ids) for o in outs)
        if got != expected_tokens:
            raise RuntimeError(f"{v.name}: {got} output tokens, expected {expected_tokens}")
        a, b = latency_ms(llm, outs)
        ttft += a
        tpot += b
        outputs += outs
    if args.keep_engines:
        v.llm = llm
    else:
        llm.close()
        del llm
        _free_device_memory()
    num_tokens = sum(len(o.output_token_ids) for o in outputs)
    v.runs.append(_run_record(num_tokens, elapsed, len(outputs), ttft, tpot) | {"digest": digest})


def _run_record(
    num_tokens: int, elapsed: float, num_requests: int, ttft: list[float], tpot: list[float]
) -> dict[str, float]:
    return {
        "output_tokens": num_tokens,
        "requests": num_requests,
        "elapsed_s": elapsed,
        "tok_s": num_tokens / elapsed,
        "ttft_ms_p50": statistics.median(ttft) if ttft else float("nan"),
        "tpot_ms_p50": statistics.median(tpot) if tpot else float("nan"),
    }


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- HF transformers generate -----------------------------------------------------------------
def hf_config(args: argparse.Namespace, w: Workload) -> Any:
    """The HF config of the workload's model shape (a named shape converted; or the folder's)."""
    from transformers import AutoConfig, Qwen3Config

    if w.model_config is None:
        return AutoConfig.from_pretrained(args.model, local_files_only=True)
    from engine.engine_parts import load_model_config

    mc = load_model_config(w.model_config)
    if mc.architecture != "Qwen3ForCausalLM":
        raise SystemExit(f"HF side: only Qwen3 shapes are converted, got {mc.architecture}")
    return Qwen3Config(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,  # type: ignore[call-arg]  # transformers 5 still takes it
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=mc.tie_word_embeddings,
    )


def build_hf(args: argparse.Namespace, w: Workload) -> Any:
    """HF ``AutoModelForCausalLM`` of the shape, random weights, made on the device in dtype."""
    from transformers import AutoModelForCausalLM

    config = hf_config(args, w)
    dtype = getattr(torch, args.dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


class _StepClock:
    """A stopping criterion that never stops: notes the time each new token was generated."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate(model: Any, batch: int, in_len: int, out_len: int, seed: int) -> dict[str, Any]:
    """One ``generate`` of ``batch`` random prompts, greedy, exactly ``out_len`` new tokens."""
    from transformers import StoppingCriteriaList

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, in_len), generator=gen).to(model.device)
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    num_new = out.shape[1] - in_len
    if num_new != out_len:
        raise RuntimeError(f"HF generate returned {num_new} new tokens, expected {out_len}")
    first = clock.times[0] if clock.times else end
    return {
        "elapsed_s": end - start,
        "output_tokens": batch * out_len,
        "ttft_ms": (first - start) * 1e3,
        "tpot_ms": (end - first) / max(out_len - 1, 1) * 1e3,
    }


def hf_run(args: argparse.Namespace, w: Workload, v: Variant, round_: int) -> None:
    """Build HF's model, warm it up (one short generate), time it and free it, as an engine
    run does (the engines size their KV cache from the device memory left free)."""
    batch = min(args.hf_batch, w.num_requests)
    start = time.perf_counter()
    model = build_hf(args, w)
    build_s = time.perf_counter() - start
    hf_generate(model, batch, w.in_len, min(8, w.out_len), WARMUP_SEED)
    v.warmups.append({"build_s": build_s, "warmup_run_s": time.perf_counter() - start - build_s})
    parts: list[dict[str, Any]] = []
    while sum(p["elapsed_s"] for p in parts) < args.min_run_s or not parts:
        parts.append(hf_generate(model, batch, w.in_len, w.out_len, 1000 * round_ + len(parts)))
    del model
    _free_device_memory()
    elapsed = sum(p["elapsed_s"] for p in parts)
    v.runs.append(
        _run_record(
            sum(p["output_tokens"] for p in parts),
            elapsed,
            batch * len(parts),
            [p["ttft_ms"] for p in parts],
            [p["tpot_ms"] for p in parts],
        )
    )


# ---- rounds and the report --------------------------------------------------------------------
def variants_of(args: argparse.Namespace, w: Workload) -> list[Variant]:
    out = [Variant("hf generate", None)] if args.hf else []
    sets = [("default", ())] + ([("tuned", w.tuned)] if args.tuned else [])
    for set_name, flags in sets:
        for mode in ("on", "off") if args.async_off else ("on",):
            out.append(Variant(f"{set_name} async {mode}", (*flags, "--async", mode)))
    for spec in args.decode_launch_ab:
        bn, warps, stages = (int(x) for x in spec.split(":"))
        launch = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "head_major": True}
        out.append(Variant(f"default on dec{bn}/{warps}/{stages}", ("--async", "on"),
                           decode_launch=launch))  # fmt: skip
    for spec in args.flags_ab:
        name, flags = spec.split("=", 1)
        out.append(Variant(f"default on {name}", ("--async", "on", *flags.split())))
    return out


def run_workload_rounds(args: argparse.Namespace, w: Workload) -> list[Variant]:
    variants = variants_of(args, w)
    expected = w.num_requests * w.out_len
    for round_ in range(args.rounds):
        for v in variants:
            if v.engine_flags is None:
                hf_run(args, w, v, round_)
            else:
                engine_run(args, w, v, round_, expected)
            r = v.runs[-1]
            print(f"  [{w.name}] round {round_ + 1}/{args.rounds} {v.name:<18} "
                  f"{r['tok_s']:>10.1f} tok/s  ({r['elapsed_s']:.1f} s)", flush=True)  # fmt: skip
    for v in variants:
        if v.llm is not None:
            v.llm.close()
            v.llm = None
    return variants


def same_tokens(variants: list[Variant]) -> dict[str, bool]:
    """Per flag set: did async on and off emit the same tokens in every round (the round's
    first repeat)? Greedy; in bf16 a different batch shape may change a token legitimately."""
    out = {}
    for on in (v for v in variants if v.name.endswith("async on")):
        off = next((v for v in variants if v.name == on.name[: -len("on")] + "off"), None)
        if off is not None:
            pairs = zip(on.runs, off.runs, strict=True)
            out[on.name[: -len(" async on")]] = all(a["digest"] == b["digest"] for a, b in pairs)
    return out


def summarise(w: Workload, variants: list[Variant]) -> dict[str, Any]:
    hf = next((v for v in variants if v.engine_flags is None), None)
    hf_tok = statistics.median(r["tok_s"] for r in hf.runs) if hf and hf.runs else None
    out: dict[str, Any] = {
        "workload": dataclasses.asdict(w),
        "async_on_off_same_tokens": same_tokens(variants),
        "variants": {},
    }
    for v in variants:
        tok = [r["tok_s"] for r in v.runs]
        med = statistics.median(tok)
        out["variants"][v.name] = {
            "flags": list(v.engine_flags) if v.engine_flags is not None else None,
            "tok_s_median": med,
            "tok_s_min": min(tok),
            "tok_s_max": max(tok),
            "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in v.runs),
            "tpot_ms_p50": statistics.median(r["tpot_ms_p50"] for r in v.runs),
            "ratio_to_hf": med / hf_tok if hf_tok else None,
            "max_num_seqs": v.warmups[0].get("max_num_seqs") if v.warmups else None,
            "warmup": v.warmups,
            "runs": v.runs,
        }
    return out


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'workload':<16} {'variant':<18} {'tok/s median':>12} {'min..max':>21} "
          f"{'TTFT p50 ms':>11} {'TPOT p50 ms':>11} {'x HF':>6} {'warm-up s':>14} {'seqs':>5}")  # fmt: skip
    for name, res in results.items():
        for vname, v in res["variants"].items():
            ratio = f"{v['ratio_to_hf']:.2f}" if v["ratio_to_hf"] is not None else "-"
            warm = [wu["build_s"] + wu["warmup_run_s"] for wu in v["warmup"]]
            warm_txt = f"{warm[0]:.1f}" + (
                f" / {statistics.median(warm[1:]):.1f}" if len(warm) > 1 else ""
            )
            print(f"{name:<16} {vname:<18} {v['tok_s_median']:>12.1f} "
                  f"{v['tok_s_min']:>10.1f}..{v['tok_s_max']:<9.1f} {v['ttft_ms_p50']:>11.1f} "
                  f"{v['tpot_ms_p50']:>11.2f} {ratio:>6} {warm_txt:>14} "
                  f"{v['max_num_seqs'] or '-'!s:>5}")  # fmt: skip
        for flag_set, same in res["async_on_off_same_tokens"].items():
            print(f"{name:<16} {flag_set}: async on/off same tokens in every round: {same}")
    print("warm-up s: engine build + warm-up run of the first run (then the median of the rest); "
          "HF: model build + a short generate; seqs: the engine's max_num_seqs")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help=f"comma list of {', '.join(WORKLOADS)}")  # fmt: skip
    p.add_argument("--with-8b", action="store_true", help="also the Qwen3-8B shape workload")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--model", default="samples/models/pycoder-14m",
                   help="model folder of workloads without a named shape (--quick)")  # fmt: skip
    p.add_argument("--tokenizer", default="samples/models/pycoder-14m",
                   help="the engine's tokenizer (as the issue's runs; '' for none)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="pin every engine's max_num_seqs (default: the engine's, sized to the "
                   "device)")  # fmt: skip
    p.add_argument("--tuned", action="store_true", help="also each workload's tuned flags")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF generate")
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="alternations of every variant")
    p.add_argument("--no-async-off", dest="async_off", action="store_false",
                   help="skip the --async off variants")  # fmt: skip
    p.add_argument("--decode-launch-ab", action="append", default=[], metavar="BLOCK_N:WARPS:STAGES",
                   help="also default flags, async on, with the decode attention kernel's launch "
                   "parameters replaced (engine.kernels.attention.DECODE_LAUNCH): an A/B of a "
                   "kernel launch against the engine's own; repeatable")  # fmt: skip
    p.add_argument("--flags-ab", action="append", default=[], metavar="NAME=FLAGS",
                   help="also default flags, async on, plus these `stepscope run` flags (one "
                   "string, e.g. 'mbt8192=--max-num-batched-tokens 8192'), as variant "
                   "'default on NAME': an A/B of a flag against the defaults; repeatable")  # fmt: skip
    p.add_argument("--min-run-s", type=float, default=10.0, help="each timed run lasts this long")
    p.add_argument("--keep-engines", action="store_true",
                   help="build each engine once and keep it between rounds (needs device memory "
                   "for all of them at once)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: the sample model, 8 x (16 -> 16), 2 rounds, short runs")  # fmt: skip
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("engine_args", nargs="*", help="more `stepscope run` flags, after --")
    args = p.parse_args(argv)
    if args.quick:
        args.device, args.min_run_s, args.hf_batch = "cpu", 0.0, 8
        args.rounds = min(args.rounds, 2)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.tokenizer = args.tokenizer or None
    if args.decode_launch_ab and args.keep_engines:
        p.error("--decode-launch-ab builds each engine per run; drop --keep-engines")
    for spec in args.decode_launch_ab:
        parts = spec.split(":")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--decode-launch-ab {spec!r}: expected BLOCK_N:WARPS:STAGES, e.g. 32:4:2")
    for spec in args.flags_ab:
        name, sep, flags = spec.partition("=")
        if not sep or not name or not flags.split():
            p.error(
                f"--flags-ab {spec!r}: expected NAME=FLAGS, e.g. mbt8192=--max-num-batched-tokens 8192"
            )
    return args


def selected_workloads(args: argparse.Namespace) -> list[Workload]:
    if args.quick:
        return [QUICK]
    names = [n for n in args.workloads.split(",") if n]
    if args.with_8b and "8b-256x128-128" not in names:
        names.append("8b-256x128-128")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.quick:  # one thread: OpenMP spinning on a shared CPU slows small models ~10x
        torch.set_num_threads(1)
    results: dict[str, dict[str, Any]] = {}
    for w in selected_workloads(args):
        print(f"{w.name}: {w.num_requests} x ({w.in_len} -> {w.out_len}), "
              f"{w.model_config or args.model}", flush=True)  # fmt: skip
        results[w.name] = summarise(w, run_workload_rounds(args, w))
        if args.out:  # after each workload: a later failure loses nothing measured
            _write(args, results)
    print_table(results)
    return _write(args, results) if args.out else {"results": results}


def _write(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    doc = {
        "results": results,
        "config": vars(args),
        "machine": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "host": platform.node(),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
