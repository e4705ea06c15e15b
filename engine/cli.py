"""``stepscope run``: run a workload on the engine, with a trace, outputs and a run summary."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from engine.config import DTYPES, SPEC_METHODS, ConfigError, EngineConfig
from engine.interrupt import Interrupt
from engine.output_writer import OutputPathError, OutputWriter, check_output_path
from engine.workload import WorkloadError, load_workload
from instrument.capture import CaptureConfig, parse_step_range
from instrument.schema import Arg, rank_trace_path

if TYPE_CHECKING:  # engine.llm imports torch: only once a run starts, never for --help
    from engine.llm import LLM, CompletionOutput
    from instrument.tracer import Tracer

__all__ = ["run_main", "build_parser"]


def _tristate(value: str) -> bool | None:
    table = {"auto": None, "on": True, "off": False}
    if value not in table:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {value!r}")
    return table[value]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stepscope run",
        description="Run a workload on the stepscope engine. Prints a run summary (requests, "
        "output tok/s, TTFT/TPOT percentiles, feature decisions, trace path).",
        epilog="Ctrl-C or SIGTERM: stop admitting, abort the requests in flight (their partial "
        "outputs written as finish_reason 'abort'), close the trace with a note, exit 130 / 143; "
        "a second Ctrl-C exits at once (the trace stays loadable).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint folder (config.json, *.safetensors, tokenizer)")
    src.add_argument(
        "--model-config",
        help="a HF config.json, a folder, or 'qwen3-0.6b' / 'qwen3-8b' (needs --random-weights)",
    )
    p.add_argument("--random-weights", action="store_true", help="seeded random weights")
    p.add_argument(
        "--tokenizer",
        help="tokenizer folder (default: the --model folder); e.g. a sample model's tokenizer "
        "for text or structured workloads on --model-config --random-weights",
    )
    p.add_argument(
        "--workload",
        required=True,
        help="a .jsonl file (vLLM parameter names), ShareGPT .json, or "
        "'synthetic:n=64,in=16-64,out=16-64,rate=8,seed=0'",
    )
    p.add_argument("--trace", help="write a Perfetto trace here (.pftrace)")
    p.add_argument("--nvtx", action="store_true", help="also emit NVTX ranges (Nsight Systems)")
    p.add_argument(
        "--trace-requests",
        action="store_true",
        help="also write one trace track per request (queued/prefill/decode; TTFT/TPOT in "
        "`stepscope analyze` come from these)",
    )
    p.add_argument(
        "--trace-steps",
        default=None,
        metavar="A:B",
        help="trace only engine steps A..B-1 ('A:' = from A on)",
    )
    p.add_argument(
        "--trace-every", type=int, default=1, metavar="N", help="trace one step in N (sampled)"
    )
    p.add_argument(
        "--trace-max-mb", type=float, default=None, metavar="M", help="trace file size budget"
    )
    p.add_argument(
        "--trace-mode",
        choices=("stop", "ring"),
        default="stop",
        help="at --trace-max-mb: stop tracing steps, or keep the most recent ones (ring)",
    )
    p.add_argument(
        "--trace-warmup",
        action="store_true",
        help="also trace the warm-up steps (left out by default)",
    )
    p.add_argument(
        "--trace-warmup-steps",
        type=int,
        default=2,
        metavar="K",
        help="how many first steps are warm-up (default 2)",
    )
    p.add_argument(
        "--detect-syncs",
        action="store_true",
        help="record every host<-device sync as a trace instant (slower)",
    )
    p.add_argument(
        "--output",
        help="write one JSON line per request here, as each finishes (rejected and aborted ones "
        "too); a complete run's file is rewritten in the workload's order at the end",
    )
    p.add_argument(
        "--async",
        dest="async_scheduling",
        type=_tristate,
        default=None,
        metavar="auto|on|off",
        help="async scheduling (batch queue of depth 2)",
    )
    p.add_argument("--cuda-graphs", type=_tristate, default=None, metavar="auto|on|off")
    p.add_argument(
        "--triton",
        dest="triton_kernels",
        type=_tristate,
        default=None,
        metavar="auto|on|off",
        help="Triton kernels (auto: on CUDA)",
    )
    p.add_argument("--pinned-memory", type=_tristate, default=None, metavar="auto|on|off")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--spec-method", choices=SPEC_METHODS, default=None)
    p.add_argument("--spec-model", default=None, help="draft model / EAGLE head / MTP folder")
    p.add_argument("--num-spec-tokens", type=int, default=0)
    p.add_argument(
        "--spec-sync-accepted",
        action="store_true",
        help="the CPU waits for accepted counts before preparing the next step",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over N ranks (N processes; NCCL on CUDA, gloo on the CPU); "
        "--trace X.pftrace then writes X.rank<i>.pftrace per rank",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        model_config=args.model_config,
        random_weights=args.random_weights,
        tokenizer=args.tokenizer,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        async_scheduling=args.async_scheduling,
        cuda_graphs=args.cuda_graphs,
        triton_kernels=args.triton_kernels,
        pinned_memory=args.pinned_memory,
        spec_method=args.spec_method,
        spec_model=args.spec_model,
        num_spec_tokens=args.num_spec_tokens,
        spec_sync_accepted=args.spec_sync_accepted,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def capture_from_args(args: argparse.Namespace) -> CaptureConfig:
    """The trace capture settings of ``--trace-*`` (raises ValueError with the reason)."""
    first, end = parse_step_range(args.trace_steps) if args.trace_steps else (0, None)
    return CaptureConfig(
        first_step=first,
        end_step=end,
        every=args.trace_every,
        max_bytes=int(args.trace_max_mb * 2**20) if args.trace_max_mb is not None else None,
        mode=args.trace_mode,
        warmup_steps=args.trace_warmup_steps,
        include_warmup=args.trace_warmup,
    )


def _fmt_pcts(d: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:8.2f}" for k, v in d.items()) if d else "n/a"


def print_summary(
    llm: LLM,
    outputs: list[CompletionOutput],
    elapsed_s: float,
    trace: str | None,
    interrupted: str = "",
    num_requests: int = 0,
) -> None:
    from engine.llm import outputs_digest

    num_out = sum(len(o.output_token_ids) for o in outputs)
    lat = llm.engine.requests.summary()
    print("\n== stepscope run summary ==")
    if interrupted:
        print(
            f"interrupted       by {interrupted}: {len(outputs)} of {num_requests} requests "
            f"admitted, {num_requests - len(outputs)} never started"
        )
    num_aborted = sum(o.finish_reason == "abort" for o in outputs)
    num_failed = sum(o.finish_reason == "error" for o in outputs)
    print(f"requests          {len(outputs)}  ({num_aborted} aborted, {num_failed} rejected)")
    print(
        f"output tokens     {num_out}  in {elapsed_s:.2f} s  = {num_out / max(elapsed_s, 1e-9):.1f} tok/s"
    )
    print(f"TTFT ms           {_fmt_pcts(lat.ttft_ms)}")
    print(f"TPOT ms           {_fmt_pcts(lat.tpot_ms)}")
    print(f"end-to-end ms     {_fmt_pcts(lat.e2e_ms)}")
    print(f"output digest     {outputs_digest(outputs)}")
    print("feature decisions:")
    for d in llm.engine.features.decisions:
        requested = d.requested
        if requested is None:  # auto, except for the spec method where None means "none asked"
            requested = "none" if d.feature == "spec_method" else "auto"
        print(f"  {d.feature:<18} requested={requested!s:<6} resolved={d.resolved!s:<6} {d.reason}")
    if trace:
        print(
            f"trace             {trace}   (stepscope analyze {trace}; or open in ui.perfetto.dev)"
        )


def _progress(total: int, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="requests", unit="req", file=sys.stderr, leave=False)
    return bar, bar.update


def run_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        capture = capture_from_args(args)
        if args.output:  # before the model loads: a wrong path fails now, not after the run
            check_output_path(args.output)
        workload = load_workload(args.workload)
    except (ConfigError, WorkloadError, OutputPathError, ValueError) as err:
        print(f"stepscope run: error: {err}", file=sys.stderr)
        return 2
    from instrument.tracer import Tracer, set_tracer

    tracer = None
    trace = args.trace
    if trace and config.tensor_parallel_size > 1:  # one trace per rank; this process is rank 0
        trace = rank_trace_path(trace, 0)
    if trace:
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
        # Signals are this command's (engine/interrupt.py), not the tracer's.
        tracer = Tracer(trace, nvtx=args.nvtx, capture=capture)
        set_tracer(tracer)
    interrupt = Interrupt(on_second=(lambda: tracer.close(blocking=False)) if tracer else None)
    try:
        return _run(args, config, workload, tracer, trace, interrupt)
    finally:
        interrupt.restore()
        if tracer is not None:
            tracer.close()


def _run(
    args: argparse.Namespace,
    config: EngineConfig,
    workload: list[Any],
    tracer: Tracer | None,
    trace: str | None,
    interrupt: Interrupt,
) -> int:
    """Build the engine, run the workload (outputs streamed to ``--output``), close in order."""
    from engine.llm import LLM, outputs_digest
    from instrument.sync_detect import SyncDetector

    detector = SyncDetector(tracer) if (tracer and args.detect_syncs) else None
    try:
        llm = LLM(config, tracer=tracer, trace_requests=args.trace_requests)
    except ConfigError as err:
        print(f"stepscope run: error: {err}", file=sys.stderr)
        return 2
    writer = None
    try:
        writer = OutputWriter(args.output) if args.output else None
        bar, update = _progress(len(workload), not args.no_progress)
        if detector is not None:
            detector.install()
        start = time.monotonic()
        outputs = llm.run_workload(
            workload,
            progress=update,
            on_finish=writer.write if writer is not None else None,
            should_stop=lambda: interrupt.requested,
        )
        elapsed = time.monotonic() - start
        if detector is not None:
            detector.uninstall()
        if bar is not None:
            bar.close()
    except (ConfigError, OutputPathError) as err:
        print(f"stepscope run: error: {err}", file=sys.stderr)
        return 2
    finally:
        llm.close()  # worker threads joined before the interpreter exits
        if writer is not None:
            writer.close()
    if tracer is not None:
        note = {Arg.INTERRUPTED.value: interrupt.name} if interrupt.requested else {}
        tracer.metadata(
            **{Arg.OUTPUT_DIGEST.value: outputs_digest(outputs)},
            num_requests=len(outputs),
            **note,
        )
        tracer.close()
    if writer is not None and not interrupt.requested:
        writer.finish_in_order(outputs)
    print_summary(llm, outputs, elapsed, trace, interrupt.name, len(workload))
    return interrupt.exit_code
