"""``stepscope run``: run a workload on the engine, with a trace, outputs and a run summary."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.config import CLI, ConfigError, EngineConfig
from engine.interrupt import Interrupt
from engine.output_writer import OutputPathError, OutputWriter, check_output_path
from engine.workload import WorkloadError, load_workload
from instrument.capture import DEFAULT_RUN_LENGTH, CaptureConfig, parse_step_range
from instrument.schema import Arg, DeviceBegins, rank_trace_path
from instrument.tracer import WRITERS, Tracer

if TYPE_CHECKING:  # engine.llm imports torch: only once a run starts, never for --help
    from engine.llm import LLM, CompletionOutput

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
    _add_config_flags(p, lambda name: name in _SOURCE_FLAGS)
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
        "--trace-every",
        type=int,
        default=1,
        metavar="N",
        help="trace one step in N (sampled), in runs of --trace-run-length consecutive steps; "
        "the engine skips the tracer's work on the others (counted in the trace's metadata)",
    )
    p.add_argument(
        "--trace-run-length",
        type=int,
        default=DEFAULT_RUN_LENGTH,
        metavar="R",
        help=f"with --trace-every N: keep runs of R consecutive steps, one run in N (default "
        f"{DEFAULT_RUN_LENGTH}; overlap and bubbles are measured inside runs)",
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
        help="also trace the workload's first --trace-warmup-steps steps (left out by default; "
        "the engine's own warm-up, --warmup, is never traced)",
    )
    p.add_argument(
        "--trace-warmup-steps",
        type=int,
        default=2,
        metavar="K",
        help="how many first steps of the workload count as warm-up in the trace (default 2)",
    )
    p.add_argument(
        "--trace-writer",
        choices=WRITERS,
        default="process",
        help="who encodes the trace: a child process (default; keeps the encoding off the "
        "engine's GIL) or a thread of this process",
    )
    p.add_argument(
        "--trace-kernels",
        default=None,
        metavar="A:B",
        help="also record the CUPTI kernel, memcpy and memset activity of engine steps A..B-1 "
        "(torch.profiler, device activity only) onto a 'gpu:<i> kernels' track of the trace, "
        "aligned to the host clock; needs --trace and a CUDA device (off by default)",
    )
    p.add_argument(
        "--trace-begins",
        choices=[b.value for b in DeviceBegins],
        default="derived",
        help="how a device slice that does not begin at the previous slice's end gets its "
        "begin: 'derived' (default) records no event and takes the latest of the host time "
        "its enqueue began, the previous slice's end on its stream and the end of the stage "
        "the stream waited for (a lower bound: a few µs before a recorded begin on the H200, "
        "tens of µs for the h2d input copies; 3 event records fewer in a plain decode step); "
        "'recorded' records an event on the stream; 'both' records the event and writes the "
        "derived begin as the slice's derived_begin_ns arg (to measure the bound: "
        "bench/bench_derived_begins.py)",
    )
    p.add_argument(
        "--trace-graph-stamps",
        choices=["on", "off"],
        default="on",
        help="with --trace and forward CUDA graphs: each captured forward graph writes the "
        "device clock (%%globaltimer) at its start and end into pinned host memory, so a traced "
        "decode step records two events fewer on the host ('input_prep' ends where the "
        "forward's first stamp says it began); 'off' records events as before (default on; "
        "the trace's metadata says graph_stamps and the calibration error)",
    )
    p.add_argument(
        "--trace-core",
        choices=["auto", "c", "python"],
        default=None,
        help="where the device timeline's per-stage work runs: 'auto' (the compiled stage core "
        "when it is built: python -m instrument.native build, which scripts/setup.sh runs; "
        "else the Python classes), 'c' (the compiled core, or an error saying why not) or "
        "'python'. Default: the STEPSCOPE_STAGE_CORE environment variable, else auto. The "
        "trace's metadata says which ran (stage_core)",
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
    _add_config_flags(p, lambda name: name not in _SOURCE_FLAGS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# The model-source flags come first in --help; the other config flags after the trace flags.
_SOURCE_FLAGS = ("model", "model_config", "random_weights", "tokenizer")


def _config_flag_fields() -> list[dataclasses.Field[Any]]:
    """The fields of ``EngineConfig``'s parts that have a flag (their ``field(metadata=...)``),
    in tree order (part by part)."""
    return [
        f
        for part in EngineConfig.part_types().values()
        for f in dataclasses.fields(part)
        if CLI in f.metadata
    ]


def _add_config_flags(p: argparse.ArgumentParser, which: Callable[[str], bool]) -> None:
    """Add the flags of the config fields ``which`` selects, generated from each field's
    metadata, so that each default lives once, in ``EngineConfig``'s parts."""
    groups: dict[str, Any] = {}
    for f in _config_flag_fields():
        if not which(f.name):
            continue
        meta = f.metadata[CLI]
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        target: Any = p
        if meta["group"] is not None:
            if meta["group"] not in groups:
                groups[meta["group"]] = p.add_mutually_exclusive_group(required=True)
            target = groups[meta["group"]]
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        kind = meta["kind"]
        if kind in ("store_true", "store_false"):
            kw["action"] = kind
        elif kind == "tristate":
            kw.update(type=_tristate, default=f.default, metavar="auto|on|off")
        else:
            kw["default"] = f.default
            if meta["choices"] is not None:
                kw["choices"] = meta["choices"]
            value_type = meta["type"] or (type(f.default) if f.default is not None else None)
            if value_type is not None and value_type is not str:
                kw["type"] = value_type
            if meta["metavar"] is not None:
                kw["metavar"] = meta["metavar"]
        target.add_argument(flag, **kw)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the parsed flags (every flagged field, by its ``dest``), parsed
    once into the tree of parts."""
    values = {f.name: getattr(args, f.name) for f in _config_flag_fields()}
    return EngineConfig.from_flat(
        **values,
        trace_kernel_steps=_kernel_steps(args),
        trace_begins=args.trace_begins,
        graph_stamps=args.trace_graph_stamps == "on",
        trace_core=args.trace_core,
    )


def _kernel_steps(args: argparse.Namespace) -> tuple[int, int] | None:
    """``--trace-kernels A:B`` as a bounded step window (raises ValueError with the reason)."""
    if args.trace_kernels is None:
        return None
    first, end = parse_step_range(args.trace_kernels)
    if end is None:
        raise ValueError(f"--trace-kernels needs a bounded window A:B, got {args.trace_kernels!r}")
    if not args.trace:
        raise ValueError("--trace-kernels writes into the trace: give --trace PATH too")
    return first, end


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
        run_length=args.trace_run_length,
    )


def tracer_from_args(args: argparse.Namespace, path: str, capture: CaptureConfig) -> Tracer:
    """The tracer ``stepscope run`` writes ``path`` with (flushes on SIGTERM/SIGINT)."""
    return Tracer(
        path,
        nvtx=args.nvtx,
        install_signal_handlers=True,
        capture=capture,
        writer=args.trace_writer,
        core=args.trace_core,
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
    warmup = llm.engine.warmup
    if warmup.num_steps:
        print(
            f"warm-up           {warmup.seconds:.2f} s  ({warmup.num_steps} dummy steps before the run, not in the run's time)"
        )
    else:
        print("warm-up           off")
    if llm.engine.compiles.counted:
        late = llm.engine.compiles_in_run
        names = ", ".join(sorted(set(late))[:4]) + (" ..." if len(set(late)) > 4 else "")
        print(
            f"Triton compiles   {llm.engine.compiles_at_start} at start-up, {len(late)} during the "
            f"run{': ' + names if late else ''}"
        )
    kv = llm.engine.kv
    print(
        f"KV cache          {kv.num_blocks} blocks x {kv.block_size} = {kv.num_tokens} tokens  ({kv.source})"
    )
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


def _print_capacity(llm: LLM, tokens_per_request: float, tracer: Tracer | None) -> None:
    """The KV pool and the concurrency it allows at this workload's lengths (start of the run;
    also into ``trace_metadata``)."""
    engine = llm.engine
    print(engine.kv.describe(engine.max_model_len))
    if tokens_per_request <= 0:
        return
    tokens = math.ceil(tokens_per_request)
    concurrency = engine.kv.concurrency(tokens)
    print(
        f"  maximum concurrency at this workload's mean {tokens} tokens per "
        f"request (prompt + max_tokens): {concurrency:.2f}x (--max-num-seqs "
        f"{engine.config.scheduler.max_num_seqs}"
        + (
            ""
            if engine.max_num_seqs_source == "max_num_seqs"
            else f", {engine.max_num_seqs_source}"
        )
        + ")"
    )
    if engine.warmup.num_steps:
        print(f"warm-up: {engine.warmup.num_steps} dummy steps in {engine.warmup.seconds:.2f} s")
    if tracer is not None:
        tracer.metadata(
            **{
                Arg.WORKLOAD_TOKENS_PER_REQUEST.value: round(tokens_per_request, 2),
                Arg.KV_MAX_CONCURRENCY_WORKLOAD.value: round(concurrency, 3),
            }
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
    from instrument.tracer import set_tracer

    tracer = None
    trace = args.trace
    if (
        trace and config.parallel.tensor_parallel_size > 1
    ):  # one trace per rank; this process is rank 0
        trace = rank_trace_path(trace, 0)
    if trace:
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
        # Signals are this command's (engine/interrupt.py), not the tracer's.
        tracer = tracer_from_args(args, trace, capture)
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
        tokens_per_request = llm.mean_request_tokens(workload)
    except ConfigError as err:
        print(f"stepscope run: error: {err}", file=sys.stderr)
        return 2
    _print_capacity(llm, tokens_per_request, tracer)
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
        if llm.engine.compiles.counted:
            tracer.metadata(**{Arg.TRITON_COMPILES_RUN.value: len(llm.engine.compiles_in_run)})
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
