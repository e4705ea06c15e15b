"""The stepscope trace contract (docs/design.md §4), defined once.

The engine's writer and the analysis reader both import this module; nothing else spells these
names. Extend it (bump ``SCHEMA_VERSION`` when a reader would misread an old trace); never rename.

Encoding in Perfetto protobuf (what ``analysis.loading.load_perfetto`` relies on):

* one process track (``ProcessDescriptor``, name ``PROCESS_NAME``) holds process-scoped instants
  (``feature_decision``, ``engine_config``, ``trace_metadata``) and the counters (one counter track
  per counter name, parented to the process track);
* CPU slices and ``sync`` instants sit on thread tracks (``ThreadDescriptor``; the engine loop's
  thread is named ``ENGINE_THREAD``);
* device slices sit on named tracks ``gpu:<i> compute`` / ``gpu:<i> copy`` parented to the process;
* per-request slices sit on tracks named ``request <id>``;
* slice args are ``debug_annotations`` keyed by the names below; ``step`` is always an int;
* a flow joins ``launch`` (step N) to ``forward`` (step N) with ``flow_id = FLOW_ID_BASE + N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "MIN_TPOT_TOKENS",
    "ttft_ms",
    "tpot_ms",
    "PROCESS_NAME",
    "ENGINE_THREAD",
    "FLOW_ID_BASE",
    "REQUESTED_AUTO",
    "CpuSlice",
    "DeviceSlice",
    "CopySlice",
    "RequestSlice",
    "Counter",
    "Instant",
    "WaitKind",
    "DeviceBegins",
    "Arg",
    "CaptureArg",
    "ConfigArg",
    "MEASURED_CONFIG_ARGS",
    "ParallelSlice",
    "rank_trace_path",
    "parse_rank_trace_path",
    "SliceSpec",
    "CPU_SLICES",
    "DEVICE_SLICES",
    "SLICE_SPECS",
    "device_track_name",
    "parse_device_track_name",
    "request_track_name",
    "parse_request_track_name",
    "DEVICE_COMPUTE",
    "DEVICE_COPY",
    "DEVICE_KERNELS",
    "DEVICE_LANES",
]

SCHEMA_VERSION = 1
PROCESS_NAME = "stepscope"
ENGINE_THREAD = "engine-core"
# Flow ids share one 64-bit space per trace; steps sit above this base so user flows stay apart.
FLOW_ID_BASE = 1 << 32
# How a feature_decision writes ``requested=None`` (auto).
REQUESTED_AUTO = "auto"


class CpuSlice(str, Enum):
    """Slices the engine loop writes on its CPU thread track."""

    STEP = "step"  # optional envelope; never blamed for a bubble
    SCHEDULE = "schedule"
    PREPARE_INPUTS = "prepare_inputs"
    LAUNCH = "launch"
    WAIT_OUTPUT = "wait_output"
    UPDATE_FROM_OUTPUT = "update_from_output"
    GRAMMAR_MASK = "grammar_mask"
    # Host work right after ``wait_output``: reading the step's copied-out output (token lists,
    # accepted counts, logprobs) into the runner output. Traces before it counted this inside
    # ``wait_output``; with it, ``wait_output`` is only the wait for the device's output event.
    READ_OUTPUT = "read_output"


class DeviceSlice(str, Enum):
    """Slices on a ``gpu:<i> compute`` track (device time measured by events)."""

    INPUT_PREP = "input_prep"
    FORWARD = "forward"
    SAMPLE = "sample"
    VERIFY = "verify"
    DRAFT = "draft"


class CopySlice(str, Enum):
    """Slices on a ``gpu:<i> copy`` track."""

    H2D_INPUTS = "h2d_inputs"
    D2H_OUTPUT = "d2h_output"


class RequestSlice(str, Enum):
    """Slices on a per-request track."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"


class Counter(str, Enum):
    """Process-scoped counters, one sample per engine step."""

    RUNNING_REQUESTS = "running_requests"
    WAITING_REQUESTS = "waiting_requests"
    KV_USAGE = "kv_usage"
    OUTPUT_PLACEHOLDERS = "output_placeholders"
    ACCEPTED_TOKENS = "accepted_tokens"
    BATCH_TOKENS = "batch_tokens"


class Instant(str, Enum):
    """Instant events."""

    SYNC = "sync"  # on the thread that synchronised
    FEATURE_DECISION = "feature_decision"  # process scoped
    ENGINE_CONFIG = "engine_config"  # process scoped; args = resolved config, flattened
    TRACE_METADATA = "trace_metadata"  # process scoped; schema version, host, dropped counts


class ParallelSlice(str, Enum):
    """Tensor-parallel slices (``engine.executor``); each rank writes its own trace.

    ``broadcast_step``: CPU, engine thread, arg ``step``: rank 0 sends a step's runner call to the
    other ranks / another rank waits for and receives it. ``all_reduce`` / ``all_gather``: on the
    rank's ``gpu:<rank> compute`` track, nested in ``forward`` (or ``draft``), no args; written
    only where the collective is host-timed (the CPU device), its duration = wait + transfer.
    """

    BROADCAST_STEP = "broadcast_step"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"


class WaitKind(str, Enum):
    """Values of the ``kind`` arg of ``wait_output``."""

    SAMPLED = "sampled"
    ACCEPTED_COUNT = "accepted_count"
    GRAMMAR = "grammar"


class DeviceBegins(str, Enum):
    """Values of ``trace_metadata``'s ``device_begins``: how device slices that do not begin at
    the previous slice's end got their begin (docs/design.md §4.3). Absent: ``recorded`` (every
    trace before issue 15)."""

    RECORDED = "recorded"  # a begin event recorded on the stream: when the stream reached it
    # No begin event: the latest of the host time the stage's enqueue began, the end of the slice
    # before it on its stream and the end of the stage its stream waited for. A lower bound of
    # the recorded begin (early by the device's reaction latency: a few µs).
    DERIVED = "derived"
    BOTH = "both"  # recorded begins, each with its derived one as the ``derived_begin_ns`` arg


class Arg(str, Enum):
    """Argument keys (debug annotation names)."""

    STEP = "step"
    NUM_REQS = "num_reqs"
    NUM_TOKENS = "num_tokens"
    NUM_PREFILL = "num_prefill"
    NUM_DECODE = "num_decode"
    NUM_SPEC_TOKENS = "num_spec_tokens"
    KIND = "kind"
    NUM_ACCEPTED = "num_accepted"
    NUM_REJECTED = "num_rejected"
    NUM_FINISHED = "num_finished"
    OP = "op"
    WHERE = "where"
    STACK = "stack"
    HOT = "hot"
    FEATURE = "feature"
    REQUESTED = "requested"
    RESOLVED = "resolved"
    REASON = "reason"
    # feature_decision: True when the engine showed the reason to the user (logged at start-up and
    # printed in the run summary). An auto decision that resolved off unseen is a silent fallback.
    SHOWN = "shown"
    REQUEST_ID = "request_id"
    NUM_OUTPUT_TOKENS = "num_output_tokens"  # on a request's decode slice (TPOT's denominator)
    NUM_PROMPT_TOKENS = "num_prompt_tokens"  # on a request's prefill slice
    OUTPUT_DIGEST = "output_digest"  # trace_metadata: digest of every request's output tokens
    # trace_metadata: the signal ("SIGINT", "SIGTERM") that stopped the run early; absent when
    # the run ended on its own. Requests in flight were aborted, those not arrived never ran.
    INTERRUPTED = "interrupted"
    SCHEMA_VERSION = "schema_version"
    # trace_metadata of a tensor-parallel rank: its rank, the world size, and its clock minus
    # rank 0's (measured at start-up; error within clock_rtt_ns / 2).
    RANK = "rank"
    WORLD_SIZE = "world_size"
    CLOCK_OFFSET_NS = "clock_offset_ns"
    CLOCK_RTT_NS = "clock_rtt_ns"
    # On a device stage slice (``gpu:<i> compute`` / ``copy``): the host time at which the CPU
    # recorded the stage's end event, i.e. finished enqueueing the stage. The slice's end is when
    # the stream reached that event, so CPU lead = slice end - host_end_ns (docs/design.md §5.14.1).
    HOST_END_NS = "host_end_ns"
    # On a device stage slice: True when the stage's work was one CUDA-graph replay (submitted at
    # once, just before its end event). Absent: the analysis infers it from the feature decisions
    # (docs/design.md §5.14.2).
    GRAPH_REPLAY = "graph_replay"
    # On a device stage slice: True when its begin and end are graph stamps, the device's own
    # clock at the graph's first and last kernel (docs/design.md §4.3): no launch gap inside.
    GRAPH_STAMPED = "graph_stamped"
    # On a kernel slice (``gpu:<i> kernels``): the device stage it ran in (``forward``, ...) and
    # its CUPTI activity kind (``kernel``, ``memcpy``, ``memset``).
    STAGE = "stage"
    ACTIVITY = "activity"
    # trace_metadata of ``stepscope run``: the workload's mean prompt + max_tokens per request and
    # how many such requests the KV pool holds at once (an upper bound, docs/design.md §2.13).
    WORKLOAD_TOKENS_PER_REQUEST = "workload_tokens_per_request"
    KV_MAX_CONCURRENCY_WORKLOAD = "kv_max_concurrency_workload"
    # trace_metadata of ``stepscope run``: Triton specializations first met inside the run (after
    # warm-up): JIT compiles the run paid (docs/design.md §2.14).
    TRITON_COMPILES_RUN = "triton_compiles_run"
    # trace_metadata: a ``DeviceBegins`` value (written when not ``recorded``; absent: recorded).
    DEVICE_BEGINS = "device_begins"
    # On a device stage slice of a ``both`` trace (int, host-clock ns): the derived begin, a lower
    # bound of the slice's recorded begin (docs/design.md §4.3).
    DERIVED_BEGIN_NS = "derived_begin_ns"
    # trace_metadata: present when graph-replayed forwards carry their own device times (graph
    # stamps, docs/design.md §4.3): "globaltimer" (CUDA: %globaltimer written by a kernel at the
    # graph's start and end, mapped to the host clock by an offset calibrated at start-up) or
    # "host" (the CPU device); graph_stamp_error_ns: half the calibration's bracket (0 on the CPU).
    # Such a step's input_prep ends where its forward's first stamp says the forward began.
    GRAPH_STAMPS = "graph_stamps"
    GRAPH_STAMP_ERROR_NS = "graph_stamp_error_ns"
    # trace_metadata: where the device timeline's per-stage work ran: "c" (the compiled stage
    # core, instrument/native.py) or "python", with why not the compiled one in parentheses
    # ("python (asked for)", "python (not built ...)"); docs/design.md §4.3.
    STAGE_CORE = "stage_core"


class ConfigArg(str, Enum):
    """``engine_config`` args the engine adds to the flattened config: what start-up resolved.

    KV pool (docs/design.md §2.13): ``kv_num_blocks`` x ``block_size`` = ``kv_num_tokens``;
    ``kv_blocks_source`` is ``num_kv_blocks`` (the flag), ``cpu default`` or
    ``gpu_memory_utilization`` (sized from device memory, with the ``kv_*_bytes`` terms of the
    budget, this rank's; the pool is the minimum over ranks). ``kv_max_concurrency``: requests of
    ``max_model_len_resolved`` tokens the pool holds at once. Warm-up (docs/design.md §2.14):
    ``warmup_s`` seconds and ``warmup_steps`` dummy steps before the workload (0 and 0 when off);
    none of its steps is in the trace.
    """

    MAX_MODEL_LEN_RESOLVED = "max_model_len_resolved"
    KV_NUM_BLOCKS = "kv_num_blocks"
    KV_NUM_TOKENS = "kv_num_tokens"
    KV_SOURCE = "kv_blocks_source"
    KV_MAX_CONCURRENCY = "kv_max_concurrency"
    KV_BYTES_PER_BLOCK = "kv_bytes_per_block"
    KV_TOTAL_BYTES = "kv_total_bytes"  # the device's total memory
    KV_FREE_BYTES = "kv_free_bytes"  # free with the weights loaded, before the runner
    KV_WEIGHTS_BYTES = "kv_weights_bytes"
    KV_RUNNER_BYTES = "kv_runner_bytes"
    KV_GRAPH_BYTES = "kv_graph_bytes"
    KV_PEAK_ACTIVATION_BYTES = "kv_peak_activation_bytes"
    WARMUP_S = "warmup_s"
    WARMUP_STEPS = "warmup_steps"
    # Triton kernel specializations this process compiled (or loaded from its disk cache) during
    # start-up (graph capture and warm-up); 0 with Triton kernels off or interpreted.
    TRITON_COMPILES_STARTUP = "triton_compiles_startup"
    # Where max_num_seqs came from: "max_num_seqs" (the flag) or the device rule's reason
    # ("auto: CUDA device of 140 GiB (>= 70)"; docs/design.md §2.1). Rank 0's config only.
    MAX_NUM_SEQS_SOURCE = "max_num_seqs_source"


# ``engine_config`` args measured at start-up rather than asked for: they differ between two runs
# of the same configuration (free memory, compile times), so an A/B contract check ignores them
# (the request behind them, ``num_kv_blocks`` / ``gpu_memory_utilization`` / ``warmup``, stays).
MEASURED_CONFIG_ARGS = frozenset(
    a.value
    for a in (
        ConfigArg.KV_NUM_BLOCKS,
        ConfigArg.KV_NUM_TOKENS,
        ConfigArg.KV_MAX_CONCURRENCY,
        ConfigArg.KV_TOTAL_BYTES,
        ConfigArg.KV_FREE_BYTES,
        ConfigArg.KV_WEIGHTS_BYTES,
        ConfigArg.KV_RUNNER_BYTES,
        ConfigArg.KV_GRAPH_BYTES,
        ConfigArg.KV_PEAK_ACTIVATION_BYTES,
        ConfigArg.WARMUP_S,
        ConfigArg.TRITON_COMPILES_STARTUP,
    )
)


class CaptureArg(str, Enum):
    """``trace_metadata`` args written by capture control (``instrument.capture``).

    The settings (``capture_*``) are written at start; the counts at close. Dropped counts are
    ``dropped_steps_<reason>`` (distinct steps) and ``dropped_events_<reason>`` (events), with
    reason one of ``warmup``, ``range``, ``sampled``, ``size`` (stop mode) and ``ring`` (evicted
    from the ring). Steps are kept or dropped whole, except at the ring's oldest edge.
    """

    STEPS = "capture_steps"  # "A:B", half-open; "A:" = no end
    EVERY = "capture_every"  # one step in N kept (1 = all): N > 1 marks a sampled trace
    MAX_BYTES = "capture_max_bytes"  # 0 = no budget
    MODE = "capture_mode"  # "stop" or "ring"
    WARMUP_STEPS = "capture_warmup_steps"  # first steps excluded as warm-up (0 = none)
    STEPS_SEEN = "steps_seen"
    STEPS_KEPT = "steps_kept"
    DROPPED_STEPS_PREFIX = "dropped_steps_"
    DROPPED_EVENTS_PREFIX = "dropped_events_"
    # --trace-kernels A:B: the engine steps whose CUPTI kernel activity is on ``gpu:<i> kernels``.
    KERNEL_STEPS = "capture_kernel_steps"
    # Written when the kernel window closes: kernel slices written, those in no stage slice, and
    # the clock alignment (host - Kineto clock, and its error bound; -1 = no marker found).
    KERNELS_WRITTEN = "kernels_written"
    KERNELS_UNATTRIBUTED = "kernels_unattributed"
    KERNEL_CLOCK_OFFSET_NS = "kernel_clock_offset_ns"
    KERNEL_CLOCK_ERROR_NS = "kernel_clock_error_ns"
    # --trace-every N keeps runs of this many consecutive steps (one run in N); 0 = not sampled.
    RUN_LENGTH = "capture_run_length"
    # Of ``dropped_steps_<reason>`` (warmup, range, sampled): the steps the engine thread skipped
    # whole (rules 1-3 applied once per step as it schedules it; the tracer paused around the
    # step's phases). Their events were never made: ``dropped_events_<reason>`` does not count
    # them. Zero counts omitted (absent = 0).
    ENGINE_SKIPPED_STEPS_PREFIX = "engine_skipped_steps_"
    # Thread-scoped instants (``sync`` hits of --detect-syncs) raised while the tracer was paused
    # for a skipped step: counted here, not written.
    ENGINE_SKIPPED_INSTANTS = "engine_skipped_instants"


@dataclass(frozen=True)
class SliceSpec:
    """A slice name with the args the writer must supply and the track kind it lives on."""

    name: str
    track: str  # "cpu", "compute", "copy" or "request"
    required_args: tuple[str, ...]


def _spec(name: Enum, track: str, *args: Arg) -> SliceSpec:
    return SliceSpec(str(name.value), track, tuple(a.value for a in args))


CPU_SLICES: tuple[SliceSpec, ...] = (
    _spec(CpuSlice.STEP, "cpu", Arg.STEP),
    _spec(
        CpuSlice.SCHEDULE,
        "cpu",
        Arg.STEP,
        Arg.NUM_REQS,
        Arg.NUM_TOKENS,
        Arg.NUM_PREFILL,
        Arg.NUM_DECODE,
        Arg.NUM_SPEC_TOKENS,
    ),
    _spec(CpuSlice.PREPARE_INPUTS, "cpu", Arg.STEP),
    _spec(CpuSlice.LAUNCH, "cpu", Arg.STEP),
    _spec(CpuSlice.WAIT_OUTPUT, "cpu", Arg.STEP, Arg.KIND),
    _spec(
        CpuSlice.UPDATE_FROM_OUTPUT,
        "cpu",
        Arg.STEP,
        Arg.NUM_ACCEPTED,
        Arg.NUM_REJECTED,
        Arg.NUM_FINISHED,
    ),
    _spec(CpuSlice.GRAMMAR_MASK, "cpu", Arg.STEP),
    _spec(CpuSlice.READ_OUTPUT, "cpu", Arg.STEP, Arg.KIND),
)

DEVICE_SLICES: tuple[SliceSpec, ...] = tuple(
    _spec(s, "compute", Arg.STEP) for s in DeviceSlice
) + tuple(_spec(s, "copy", Arg.STEP) for s in CopySlice)

REQUEST_SLICES: tuple[SliceSpec, ...] = tuple(
    _spec(s, "request", Arg.REQUEST_ID) for s in RequestSlice
)

SLICE_SPECS: dict[str, SliceSpec] = {s.name: s for s in CPU_SLICES + DEVICE_SLICES + REQUEST_SLICES}

DEVICE_COMPUTE = "compute"
DEVICE_COPY = "copy"
# CUPTI kernel / memcpy / memset activity of a --trace-kernels window, one slice per kernel.
DEVICE_KERNELS = "kernels"
DEVICE_LANES = (DEVICE_COMPUTE, DEVICE_COPY, DEVICE_KERNELS)


def device_track_name(device_index: int, lane: str) -> str:
    """``gpu:<i> compute``, ``gpu:<i> copy`` or ``gpu:<i> kernels``."""
    if lane not in DEVICE_LANES:
        raise ValueError(f"device lane must be one of {DEVICE_LANES}, got {lane!r}")
    return f"gpu:{device_index} {lane}"


def parse_device_track_name(name: str) -> tuple[int, str] | None:
    """Inverse of :func:`device_track_name`; ``None`` for any other track name."""
    if not name.startswith("gpu:"):
        return None
    head, _, lane = name[4:].partition(" ")
    if not head.isdigit() or lane not in DEVICE_LANES:
        return None
    return int(head), lane


def request_track_name(request_id: str) -> str:
    return f"request {request_id}"


def parse_request_track_name(name: str) -> str | None:
    return name[len("request ") :] if name.startswith("request ") else None


# Request latency from a request track's timestamps (docs/design.md §5.9). The definition lives
# with the track it reads so that the writer's run summary (engine/request_timeline.py) and the
# reader (analysis/metrics/latency.py) compute the same numbers; plain arithmetic, so it takes Python
# numbers or numpy/pandas arrays alike. arrival = start of the first slice (``queued``); first
# token = end of the last ``prefill``; finish = end of the last slice (``decode``).
MIN_TPOT_TOKENS = 2  # TPOT is the time per token after the first: undefined below two tokens


def ttft_ms(arrival_ns: Any, first_token_ns: Any) -> Any:
    """Time to first token in ms: ``(first_token_ns - arrival_ns) / 1e6``."""
    return (first_token_ns - arrival_ns) / 1e6


def tpot_ms(first_token_ns: Any, finish_ns: Any, num_output_tokens: Any) -> Any:
    """Time per output token after the first, in ms: ``(finish_ns - first_token_ns) / 1e6 /
    (num_output_tokens - 1)``; callers pass ``num_output_tokens >= MIN_TPOT_TOKENS``."""
    return (finish_ns - first_token_ns) / 1e6 / (num_output_tokens - 1)


def rank_trace_path(path: str, rank: int) -> str:
    """Rank ``rank``'s trace file beside ``path``: ``run.pftrace`` -> ``run.rank1.pftrace``
    (a ``run.rank0.pftrace`` given for rank 0 becomes ``run.rank1.pftrace`` for rank 1)."""
    parsed = parse_rank_trace_path(path)
    stem, ext = (parsed[0], parsed[2]) if parsed else _split_ext(path)
    return f"{stem}.rank{rank}{ext}"


def parse_rank_trace_path(path: str) -> tuple[str, int, str] | None:
    """``run.rank1.pftrace`` -> ``("run", 1, ".pftrace")``; None for other names."""
    stem, ext = _split_ext(path)
    head, dot, tail = stem.rpartition(".rank")
    if not dot or not tail.isdigit():
        return None
    return head, int(tail), ext


def _split_ext(path: str) -> tuple[str, str]:
    base = path.rsplit("/", 1)[-1]
    if "." not in base:
        return path, ""
    cut = len(path) - len(base) + base.rindex(".")
    return path[:cut], path[cut:]
