"""Engine configuration and the start-up resolution of every performance feature.

``EngineConfig`` holds what the user asked for: a frozen tree of parts (docs/design.md §2.1),
each part validated on construction and passed as it is to what it configures:

=============== ===================== ===========================================================
tree field      part                  read by
=============== ===================== ===========================================================
``source``      :class:`ModelSource`  the model factories (checkpoint / shape, dtype, seed)
``parallel``    :class:`ParallelConfig`  the device factory and the tensor-parallel ranks
``scheduler``   :class:`SchedulerConfig` the scheduler and the runner (its sizes)
``cache``       :class:`CacheConfig`  the scheduler's block pool, the runner's KV cache, proposers
``requested``   :class:`FeatureRequests` :func:`resolve_features` only
``spec``        :class:`SpecConfig`   the proposer factory, the scheduler (lookahead slots)
``tracing``     :class:`TracingConfig` the core (kernel windows)
=============== ===================== ===========================================================

Each field's ``stepscope run`` flag is described in its ``field(metadata={CLI: ...})`` (engine.cli
generates the flags from it), so each default lives here only. Field names are unique across the
parts; they are the keys of :meth:`EngineConfig.flat` (the trace's ``engine_config`` instant) and
of :meth:`EngineConfig.from_flat` (``LLM(**fields)``).

:func:`resolve_features` turns each request (True / False / None = auto) into a
:class:`FeatureDecision` once, at start-up: an explicit True that cannot be honoured raises
:class:`ConfigError` with the reason; ``None`` resolves with a reason that is logged, printed in
the run summary and written to the trace. The user's request is never overwritten: the resolved
values live in :class:`ResolvedFeatures`, the one owner of decisions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = [
    "CLI",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "FeatureDecision",
    "FeatureRequests",
    "ModelSource",
    "ParallelConfig",
    "ResolvedFeatures",
    "SchedulerConfig",
    "SpecConfig",
    "TracingConfig",
    "mixed_graph_max_tokens",
    "resolve_features",
    "SPEC_METHODS",
    "DTYPES",
]

SPEC_METHODS = ("draft", "eagle", "mtp", "ngram")
# The key of a field's metadata that describes its command-line flag (engine.cli reads it).
CLI = "cli"
# A field with ``metadata={TRACED: False}`` stays out of the trace's ``engine_config`` (a field
# added after traces existed that no flag sets: A/B against older traces sees no new key).
TRACED = "traced"
DTYPES = ("float32", "bfloat16", "float16")

# ``max_num_seqs`` by device when not given (docs/design.md §2.1, "Batch limits"): vLLM's
# get_batch_defaults gives devices of >= 70 GiB 1024 requests a step and smaller ones 256. The CPU
# keeps a small batch (the sample model, the tests).
LARGE_DEVICE_GIB = 70
LARGE_DEVICE_MAX_NUM_SEQS = 1024
SMALL_DEVICE_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64


def default_max_num_seqs(device_total_bytes: int | None) -> tuple[int, str]:
    """``max_num_seqs`` when not given, and why: by the CUDA device's total memory
    (``None``: the CPU)."""
    if device_total_bytes is None:
        return CPU_MAX_NUM_SEQS, "auto: CPU device"
    gib = device_total_bytes / 2**30
    if gib >= LARGE_DEVICE_GIB:
        return (
            LARGE_DEVICE_MAX_NUM_SEQS,
            f"auto: CUDA device of {gib:.0f} GiB (>= {LARGE_DEVICE_GIB})",
        )
    return SMALL_DEVICE_MAX_NUM_SEQS, f"auto: CUDA device of {gib:.0f} GiB (< {LARGE_DEVICE_GIB})"


def _flag(
    default: Any,
    *,
    help: str,  # noqa: A002 -- argparse's name
    kind: str = "value",
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    type: Callable[[str], Any] | None = None,  # noqa: A002 -- argparse's name
    metavar: str | None = None,
    group: str | None = None,
) -> Any:
    """A config field with its ``stepscope run`` flag: the default lives here only.

    ``kind``: ``value`` (``--name X``, typed like the default or ``type``), ``tristate``
    (``auto|on|off`` = None / True / False), ``store_true`` or ``store_false`` (``--no-x``).
    ``flag`` defaults to ``--`` + the field name with dashes; ``group`` names a mutually
    exclusive, required group (``source``: exactly one of --model / --model-config)."""
    meta = {
        "help": help,
        "kind": kind,
        "flag": flag,
        "choices": choices,
        "type": type,
        "metavar": metavar,
        "group": group,
    }
    return field(default=default, metadata={CLI: meta})


class ConfigError(ValueError):
    """An impossible configuration, named with the reason, at start-up."""


@dataclass(frozen=True)
class FeatureDecision:
    """One performance switch: what was asked, what runs, and why."""

    feature: str
    requested: bool | str | None  # None = auto
    resolved: bool | str
    reason: str

    @property
    def silent_fallback(self) -> bool:
        """Asked for explicitly, not running, and no reason given."""
        return self.requested is True and self.resolved is False and not self.reason


def _at_least_one(part: object, *names: str) -> None:
    for name in names:
        if getattr(part, name) is not None and getattr(part, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(part, name)}")


@dataclass(frozen=True)
class ModelSource:
    """Which weights (a checkpoint folder, or a shape with seeded random weights), in what dtype."""

    model: str | None = _flag(
        None,
        help="HF checkpoint folder (config.json, *.safetensors, tokenizer)",
        group="source",
    )
    model_config: str | None = _flag(
        None,
        help="a HF config.json, a folder, or 'qwen3-0.6b' / 'qwen3-8b' (needs --random-weights)",
        group="source",
    )
    random_weights: bool = _flag(False, kind="store_true", help="seeded random weights")
    tokenizer: str | None = _flag(
        None,
        help="tokenizer folder (default: the --model folder); e.g. a sample model's tokenizer "
        "for text or structured workloads on --model-config --random-weights",
    )
    seed: int = _flag(0, help="the seed of random weights and of sampling")
    dtype: str = _flag("float32", choices=DTYPES, help="model dtype")
    batch_invariant: bool = _flag(
        False,
        kind="store_true",
        help="batch-invariant kernels: a token's logits do not depend on the batch it runs in "
        "(GEMMs in fixed 256-row chunks, decode attention on the verify kernel), so speculative "
        "greedy runs emit exactly the tokens of plain decoding; slower (exactness checks)",
    )

    def __post_init__(self) -> None:
        if (self.model is None) == (self.model_config is None):
            raise ConfigError("give exactly one of model (a checkpoint folder) or model_config")
        if self.model_config is not None and not self.random_weights:
            raise ConfigError("model_config needs random_weights=True (it has no weights)")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):
            raise ConfigError(f"tokenizer {self.tokenizer!r} is not a folder")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Where the engine runs: the device, and the ranks of tensor parallelism
    (engine.executor: one process per rank, rank 0 here)."""

    device: str = _flag("cpu", help="cpu, cuda or cuda:N")
    tensor_parallel_size: int = _flag(
        1,
        metavar="N",
        help="tensor parallelism over N ranks (N processes; NCCL on CUDA, gloo on the CPU); "
        "--trace X.pftrace then writes X.rank<i>.pftrace per rank",
    )

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def cuda_index(self) -> int:
        """The configured GPU's index (``cuda`` = 0); meaningful on CUDA only."""
        return int(self.device.split(":")[1]) if ":" in self.device else 0


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. ``max_model_len = None`` asks for what the model and the KV pool
    allow; the engine passes the scheduler and the runner this part with it resolved
    (:meth:`EngineConfig.resolved`). ``long_prefill_token_threshold = 0`` turns the
    per-request prefill cap off. ``debug_invariants`` checks the scheduler invariants after every
    ``schedule`` / ``update_from_output`` (slow; tests)."""

    max_num_seqs: int | None = _flag(
        None,
        type=int,
        help="most requests scheduled in one step (default: sized to the device, vLLM's rule: "
        f"{LARGE_DEVICE_MAX_NUM_SEQS} on a CUDA device of >= {LARGE_DEVICE_GIB} GiB, "
        f"{SMALL_DEVICE_MAX_NUM_SEQS} on a smaller one, {CPU_MAX_NUM_SEQS} on the CPU)",
    )
    max_num_batched_tokens: int = _flag(2048, help="most tokens scheduled in one step")
    max_model_len: int | None = _flag(
        None, type=int, help="longest prompt + output (default: what the model and KV pool allow)"
    )
    enable_chunked_prefill: bool = _flag(
        True, kind="store_false", flag="--no-chunked-prefill", help="turn off chunked prefill"
    )
    debug_invariants: bool = False  # no flag: the scheduler's invariant checks (tests)
    long_prefill_token_threshold: int = field(default=0, metadata={TRACED: False})  # no flag

    def __post_init__(self) -> None:
        _at_least_one(self, "max_num_seqs", "max_num_batched_tokens")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            if self.max_model_len > self.max_num_batched_tokens:
                raise ConfigError(
                    "without chunked prefill, max_model_len "
                    f"({self.max_model_len}) must fit max_num_batched_tokens "
                    f"({self.max_num_batched_tokens})"
                )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 0 (0 = off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ConfigError(
                "long_prefill_token_threshold chunks prompts: it needs chunked prefill"
            )

    @property
    def resolved_max_num_seqs(self) -> int:
        """``max_num_seqs``, which the engine has resolved before it passes this part on."""
        if self.max_num_seqs is None:
            raise ConfigError("max_num_seqs is not resolved (EngineConfig.with_batch_limits)")
        return self.max_num_seqs

    @property
    def resolved_max_model_len(self) -> int:
        """``max_model_len``, which the engine has resolved before it passes this part on."""
        if self.max_model_len is None:
            raise ConfigError("max_model_len is not resolved (EngineConfig.resolved)")
        return self.max_model_len


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: one pool of ``num_kv_blocks`` blocks of ``block_size`` slots, shared by
    the scheduler's block pool, the runner's KV cache and the proposers' draft caches.
    ``num_kv_blocks = None`` asks for the pool start-up sizes (``engine.memory_profile``); the
    engine passes this part on with it resolved (:meth:`EngineConfig.resolved`)."""

    block_size: int = _flag(16, help="KV cache block size in tokens (a power of two)")
    num_kv_blocks: int | None = _flag(
        None,
        type=int,
        help="KV cache blocks (default: on CUDA, what --gpu-memory-utilization leaves after "
        "weights, runner buffers, CUDA graphs and a profiling step; 1024 on the CPU)",
    )
    gpu_memory_utilization: float = _flag(
        0.9,
        help="fraction of the device's total memory the engine may use, other processes' "
        "memory included (vLLM's meaning); sizes the KV cache unless --num-kv-blocks is given",
    )
    enable_prefix_caching: bool = _flag(
        True, kind="store_false", flag="--no-prefix-caching", help="turn off prefix caching"
    )

    def __post_init__(self) -> None:
        _at_least_one(self, "block_size")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def resolved_num_kv_blocks(self) -> int:
        """``num_kv_blocks``, which the engine has resolved before it passes this part on."""
        if self.num_kv_blocks is None:
            raise ConfigError("num_kv_blocks is not resolved (EngineConfig.resolved)")
        return self.num_kv_blocks


@dataclass(frozen=True)
class FeatureRequests:
    """Performance features as asked: True / False / None (auto). Read only by
    :func:`resolve_features`; everything else reads :class:`ResolvedFeatures`."""

    async_scheduling: bool | None = _flag(
        None, kind="tristate", flag="--async", help="async scheduling (batch queue of depth 2)"
    )
    cuda_graphs: bool | None = _flag(
        None, kind="tristate", help="CUDA graphs for uniform decode batches (auto: on CUDA)"
    )
    mixed_graph_max_tokens: int | None = _flag(
        None,
        type=int,
        metavar="N",
        help="CUDA graphs for mixed/prefill steps over padded token buckets up to N tokens "
        "(16, 32, .., 256, then multiples of 256; larger steps run eagerly); default: "
        "--max-num-batched-tokens when CUDA graphs and Triton are on; 0: mixed steps run eagerly",
    )
    spec_cuda_graphs: bool | None = _flag(
        None,
        kind="tristate",
        help="CUDA graphs for speculative steps (verifies with k drafts, prefill chunks and "
        "trimmed drafts mixed in): target forward, verify and the draft chain replayed per "
        "padded token bucket up to min(max_num_batched_tokens, 2 * max_num_seqs * (1+k)) "
        "(auto: on with CUDA graphs, Triton and a --spec-method)",
    )
    triton_kernels: bool | None = _flag(
        None, kind="tristate", flag="--triton", help="Triton kernels (auto: on CUDA)"
    )
    pinned_memory: bool | None = _flag(
        None, kind="tristate", help="pinned host staging buffers (auto: on CUDA)"
    )
    warmup: bool | None = _flag(
        None,
        kind="tristate",
        help="before the workload, run dummy steps that compile every kernel specialization a "
        "run can reach (auto: on CUDA; the CPU has nothing to compile)",
    )
    deferred_sampling: bool | None = None  # no flag: follows async scheduling under auto


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding as asked. ``num_spec_tokens`` is 0 without a method."""

    spec_method: str | None = _flag(None, choices=SPEC_METHODS, help="speculative decoding")
    spec_model: str | None = _flag(None, help="draft model / EAGLE head / MTP folder")
    num_spec_tokens: int = _flag(0, help="proposed tokens per step (with --spec-method)")
    spec_sync_accepted: bool = _flag(
        False,
        kind="store_true",
        help="the CPU waits for accepted counts before preparing the next step",
    )

    def __post_init__(self) -> None:
        if self.spec_method is not None and self.spec_method not in SPEC_METHODS:
            raise ConfigError(
                f"spec_method must be one of {SPEC_METHODS} or None, got {self.spec_method!r}"
            )
        if self.spec_method is not None and self.num_spec_tokens < 1:
            raise ConfigError("a spec_method needs num_spec_tokens >= 1")
        if self.spec_method is None and self.num_spec_tokens:
            raise ConfigError("num_spec_tokens given without a spec_method")
        if self.spec_method in ("draft", "eagle") and self.spec_model is None:
            raise ConfigError(f"spec_method={self.spec_method!r} needs spec_model (a folder)")


@dataclass(frozen=True)
class TracingConfig:
    """What the engine itself records beyond the tracer's own settings."""

    # --trace-kernels A:B: CUPTI kernel activity of steps [A, B) (instrument.kernel_window; the
    # flag is engine.cli's, which checks it against --trace).
    trace_kernel_steps: tuple[int, int] | None = None
    # --trace-begins: how device slices that do not begin at the previous slice's end get their
    # begin: a recorded event, derived from times already known (a lower bound, no event), or
    # both (to measure the bound); instrument.device_timeline, docs/design.md §4.3. The flag is
    # engine.cli's. Default derived: on the H200 it is 1-5 µs before the recorded begin of the
    # compute and output-copy stages, and both are far before the first copy of h2d_inputs.
    trace_begins: str = "derived"
    # --trace-graph-stamps: a traced run's forward CUDA graphs write their own begin and end
    # times (instrument.graph_stamps; two event records fewer per traced decode step).
    graph_stamps: bool = True
    # --trace-core: where the device timeline's per-stage work runs: "auto" (the compiled stage
    # core when it is built, else Python), "c" (the compiled one or an error), "python"; None: the
    # STEPSCOPE_STAGE_CORE environment variable, else auto (instrument/native.py, docs/design.md
    # §4.3). The flag is engine.cli's.
    trace_core: str | None = None

    def __post_init__(self) -> None:
        if self.trace_core not in (None, "auto", "c", "python"):
            raise ConfigError(f"trace_core must be auto, c or python, got {self.trace_core!r}")
        if self.trace_kernel_steps is not None:
            first, end = self.trace_kernel_steps
            if first < 0 or end <= first:
                raise ConfigError(f"trace_kernel_steps [{first}, {end}) is empty or negative")
        if self.trace_begins not in ("recorded", "derived", "both"):
            raise ConfigError(
                f"trace_begins must be recorded, derived or both, got {self.trace_begins!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for: the frozen tree of parts, each passed as it is to what it
    configures (module docstring). Build it from flat field names with :meth:`from_flat`."""

    source: ModelSource
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    requested: FeatureRequests = field(default_factory=FeatureRequests)
    spec: SpecConfig = field(default_factory=SpecConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def __post_init__(self) -> None:
        """What spans parts (each part checked its own fields)."""
        if self.source.batch_invariant and self.parallel.tensor_parallel_size > 1:
            raise ConfigError(
                "batch_invariant needs tensor_parallel_size=1 (a row-parallel GEMM's all-reduce "
                "sums partial products in an order of its own)"
            )
        top = self.requested.mixed_graph_max_tokens
        if top is not None and not 0 <= top <= self.scheduler.max_num_batched_tokens:
            raise ConfigError(
                "mixed_graph_max_tokens must be in [0, max_num_batched_tokens="
                f"{self.scheduler.max_num_batched_tokens}], got {top}"
            )

    def parts(self) -> Iterator[Any]:
        """The parts, in tree order."""
        for f in fields(self):
            yield getattr(self, f.name)

    @classmethod
    def part_types(cls) -> dict[str, type]:
        """Tree field name -> part class, in tree order."""
        return {f.name: _PART_TYPES[f.name] for f in fields(cls)}

    @classmethod
    def from_flat(cls, **values: Any) -> EngineConfig:
        """The config of flat field names (``model=``, ``max_num_seqs=``, ...): each value goes to
        the part that owns the field; an unknown name is a TypeError."""
        by_part: dict[str, dict[str, Any]] = {name: {} for name in _PART_TYPES}
        for key, value in values.items():
            if key not in _OWNER:
                raise TypeError(f"unknown engine config field {key!r}")
            by_part[_OWNER[key]][key] = value
        return cls(**{name: _PART_TYPES[name](**kw) for name, kw in by_part.items()})

    def with_batch_limits(self, device_total_bytes: int | None) -> tuple[EngineConfig, str]:
        """This config with ``max_num_seqs`` resolved (by :func:`default_max_num_seqs` from the
        device's total memory, ``None`` = the CPU, when not given), and where it came from:
        ``"max_num_seqs"`` (the flag) or the auto rule's reason. The engine core resolves it
        first, so every part, the trace's ``engine_config`` included, sees a number."""
        if self.scheduler.max_num_seqs is not None:
            return self, "max_num_seqs"
        seqs, why = default_max_num_seqs(device_total_bytes)
        return replace(self, scheduler=replace(self.scheduler, max_num_seqs=seqs)), why

    def resolved(self, max_model_len: int, num_kv_blocks: int) -> EngineConfig:
        """This config with what start-up resolves filled in: the scheduler's ``max_model_len``
        and the cache's ``num_kv_blocks`` (what the scheduler, the runner and the proposers are
        given; ``max_num_seqs`` is already resolved, :meth:`with_batch_limits`)."""
        self.scheduler.resolved_max_num_seqs  # noqa: B018 (raises when not resolved)
        return replace(
            self,
            scheduler=replace(self.scheduler, max_model_len=max_model_len),
            cache=replace(self.cache, num_kv_blocks=num_kv_blocks),
        )

    def flat(self) -> dict[str, Any]:
        """The config as flat scalars, for the trace's ``engine_config`` instant (the keys are the
        field names: the trace contract, docs/design.md §4.6)."""
        out: dict[str, Any] = {}
        for part in self.parts():
            for f in fields(part):
                if not f.metadata.get(TRACED, True):
                    continue
                value = getattr(part, f.name)
                out[f.name] = ",".join(map(str, value)) if isinstance(value, tuple) else value
        return out


_PART_TYPES: dict[str, type] = {
    "source": ModelSource,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "requested": FeatureRequests,
    "spec": SpecConfig,
    "tracing": TracingConfig,
}
# Flat field name -> the tree field of the part that owns it (names are unique across parts).
_OWNER: dict[str, str] = {f.name: part for part, t in _PART_TYPES.items() for f in fields(t)}
assert len(_OWNER) == sum(len(fields(t)) for t in _PART_TYPES.values()), "duplicate field name"


@dataclass
class ResolvedFeatures:
    """The decisions, by feature name, plus typed accessors for what the engine reads.

    The one owner of every feature decision (docs/design.md §2.1). Resolved before start-up;
    an outcome known only during start-up (a failed CUDA-graph capture) is reported here with
    :meth:`fall_back` before the trace records the decisions, so ``feature_decision`` says what
    actually runs."""

    decisions: tuple[FeatureDecision, ...]

    def fall_back(self, feature: str, reason: str) -> None:
        """``feature`` failed at start-up: under auto it resolves False with ``reason``; an
        explicit True is a :class:`ConfigError` naming the reason."""
        for i, d in enumerate(self.decisions):
            if d.feature != feature:
                continue
            if d.requested is True:
                raise ConfigError(f"{feature}=True cannot be honoured: {reason}")
            fallen = replace(d, resolved=False, reason=f"auto: off, {reason}")
            self.decisions = self.decisions[:i] + (fallen,) + self.decisions[i + 1 :]
            return
        raise KeyError(feature)

    def _get(self, feature: str) -> bool | str:
        for d in self.decisions:
            if d.feature == feature:
                return d.resolved
        raise KeyError(feature)

    @property
    def async_scheduling(self) -> bool:
        return bool(self._get("async_scheduling"))

    @property
    def cuda_graphs(self) -> bool:
        return bool(self._get("cuda_graphs"))

    @property
    def triton_kernels(self) -> bool:
        return bool(self._get("triton_kernels"))

    @property
    def mixed_cuda_graphs(self) -> bool:
        return bool(self._get("mixed_cuda_graphs"))

    @property
    def spec_cuda_graphs(self) -> bool:
        return bool(self._get("spec_cuda_graphs"))

    @property
    def pinned_memory(self) -> bool:
        return bool(self._get("pinned_memory"))

    @property
    def deferred_sampling(self) -> bool:
        return bool(self._get("deferred_sampling"))

    @property
    def trace_kernels(self) -> bool:
        return bool(self._get("trace_kernels"))

    @property
    def warmup(self) -> bool:
        return bool(self._get("warmup"))

    @property
    def spec_method(self) -> str | None:
        value = self._get("spec_method")
        return None if value in ("none", False) else str(value)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _decide(
    feature: str, requested: bool | None, possible: bool, why_not: str, auto_on: str
) -> FeatureDecision:
    """The common rule: explicit True must be possible; auto follows possibility."""
    if requested is True and not possible:
        raise ConfigError(f"{feature}=True cannot be honoured: {why_not}")
    if requested is False:
        return FeatureDecision(feature, False, False, "off as requested")
    if requested is True:
        return FeatureDecision(feature, True, True, "on as requested")
    if possible:
        return FeatureDecision(feature, None, True, f"auto: {auto_on}")
    return FeatureDecision(feature, None, False, f"auto: off, {why_not}")


def resolve_features(config: EngineConfig, cuda_available: bool | None = None) -> ResolvedFeatures:
    """Resolve every performance feature once. Raises :class:`ConfigError` on impossible asks."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if config.parallel.is_cuda and not cuda_available:
        raise ConfigError(f"device={config.parallel.device!r} but torch sees no CUDA device")
    on_cuda = config.parallel.is_cuda
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not _triton_importable():
        triton_why = "triton is not installed"
    else:
        triton_why = "CPU device: Triton runs only under TRITON_INTERPRET=1; torch kernels used"
    # Auto picks Triton on CUDA only; on the CPU the interpreter is for tests, asked explicitly.
    triton_possible = _triton_importable() and (on_cuda or interpret)
    triton_decision = _decide(
        "triton_kernels",
        config.requested.triton_kernels,
        triton_possible,
        triton_why,
        # Sampling runs the split-vocab kernels when the vocab has more than one chunk, the
        # per-row ones otherwise (engine/kernels/sampling_split.py, docs/design.md §2.15).
        "Triton kernels for attention, input prep and sampling (split-vocab sampling for a "
        "vocab over one chunk)",
    )
    if config.requested.triton_kernels is None and not on_cuda and triton_decision.resolved:
        triton_decision = FeatureDecision("triton_kernels", None, False, f"auto: off, {triton_why}")
    decisions = [
        _decide(
            "async_scheduling",
            config.requested.async_scheduling,
            True,
            "",
            "batch queue of depth 2 schedules step N+1 while step N runs"
            + ("" if on_cuda else " (CPU device: overlap bounded by the GIL)"),
        ),
        _decide(
            "cuda_graphs",
            config.requested.cuda_graphs,
            on_cuda,
            "no CUDA device (graphs capture CUDA work only)",
            "decode batches padded to capture sizes replay CUDA graphs",
        ),
        triton_decision,
        _decide(
            "pinned_memory",
            config.requested.pinned_memory,
            on_cuda,
            "no CUDA device: host memory need not be pinned",
            "pinned staging buffers make host-to-device copies asynchronous",
        ),
    ]
    async_on = bool(decisions[0].resolved)
    decisions.append(
        _decide(
            "deferred_sampling",
            config.requested.deferred_sampling,
            async_on,
            "async scheduling is off: sampling is never ahead of the grammar",
            "structured requests run forward N+1 early and sample once t_N is accepted",
        )
    )
    method = config.spec.spec_method
    decisions.append(
        FeatureDecision(
            "spec_method",
            method,
            method or "none",
            f"speculative decoding with {method}, {config.spec.num_spec_tokens} tokens per step"
            + (", CPU waits for accepted counts" if config.spec.spec_sync_accepted else "")
            if method
            else "no speculative decoding requested",
        )
    )
    decisions.append(_trace_kernels_decision(config, on_cuda))
    decisions.append(_mixed_graphs_decision(config, decisions))
    decisions.append(_spec_graphs_decision(config, decisions))
    decisions.append(_warmup_decision(config.requested.warmup, on_cuda))
    return ResolvedFeatures(tuple(decisions))


def mixed_graph_max_tokens(config: EngineConfig) -> int:
    """The largest mixed-step token bucket asked for (default: ``max_num_batched_tokens``)."""
    if config.requested.mixed_graph_max_tokens is None:
        return config.scheduler.max_num_batched_tokens
    return config.requested.mixed_graph_max_tokens


def _mixed_graphs_decision(
    config: EngineConfig, decisions: list[FeatureDecision]
) -> FeatureDecision:
    """``mixed_cuda_graphs`` (docs/design.md §2.6): requested by ``mixed_graph_max_tokens``
    (None = auto, 0 = off, N > 0 = on); needs decode graphs, the Triton kernels (the varlen
    attention grid depends only on the padded shape; the torch reference sizes its work by host
    bounds) and no proposer (verify and draft steps are not covered)."""
    resolved = {d.feature: d.resolved for d in decisions}
    max_tokens = config.requested.mixed_graph_max_tokens
    requested = None if max_tokens is None else max_tokens > 0
    why_not = ""
    if not resolved["cuda_graphs"]:
        why_not = "cuda_graphs is off (mixed-step graphs are captured with the decode graphs)"
    elif not resolved["triton_kernels"]:
        why_not = "triton_kernels is off (the torch attention reference is not capturable)"
    elif resolved["spec_method"] != "none":
        why_not = "speculative decoding: verify and draft steps run eagerly (not covered)"
    top = mixed_graph_max_tokens(config)
    return _decide(
        "mixed_cuda_graphs",
        requested,
        not why_not,
        why_not,
        f"mixed/prefill steps of <= {top} tokens replay CUDA graphs over padded token buckets "
        "(engine_config mixed_graph_buckets); larger steps run eagerly",
    )


def _spec_graphs_decision(
    config: EngineConfig, decisions: list[FeatureDecision]
) -> FeatureDecision:
    """``spec_cuda_graphs`` (docs/design.md §2.6): speculative steps whose tokens fit a bucket
    (verifies with ``k`` drafts, prefill chunks and trimmed drafts mixed in; greedy or plain
    random sampling, logprobs included; no grammar, penalties or top-k/top-p/min-p) replay
    captured graphs of the target forward, verify and the draft chain; other speculative steps
    run eagerly (engine/runner/spec_graphs.py counts why). Needs decode graphs, the Triton
    kernels and a proposer."""
    resolved = {d.feature: d.resolved for d in decisions}
    why_not = ""
    if resolved["spec_method"] == "none":
        why_not = "no speculative decoding"
    elif not resolved["cuda_graphs"]:
        why_not = "cuda_graphs is off (speculative graphs are captured with the decode graphs)"
    elif not resolved["triton_kernels"]:
        why_not = "triton_kernels is off (the torch attention reference is not capturable)"
    sched = config.scheduler
    # engine/runner/spec_graphs.spec_buckets: the largest bucket.
    k1 = 1 + config.spec.num_spec_tokens
    top: int | str = (
        f"min(max_num_batched_tokens, 2 x max_num_seqs x {k1})"
        if sched.max_num_seqs is None
        else min(sched.max_num_batched_tokens, 2 * sched.max_num_seqs * k1)
    )
    return _decide(
        "spec_cuda_graphs",
        config.requested.spec_cuda_graphs,
        not why_not,
        why_not,
        f"speculative steps of <= {top} tokens (verifies with k drafts, prefill chunks and "
        "trimmed drafts mixed in; greedy or plain random sampling, logprobs included) replay "
        "forward, verify and draft graphs over padded token buckets; larger steps and steps "
        "with grammar, penalties or top-k/top-p/min-p run eagerly",
    )


def _warmup_decision(requested: bool | None, on_cuda: bool) -> FeatureDecision:
    """Warm-up (engine/warmup.py) is always possible; auto runs it where kernels compile."""
    if requested is not None:
        return FeatureDecision(
            "warmup", requested, requested, f"{'on' if requested else 'off'} as requested"
        )
    if on_cuda:
        return FeatureDecision(
            "warmup",
            None,
            True,
            "auto: dummy steps compile every kernel specialization before the workload",
        )
    return FeatureDecision(
        "warmup", None, False, "auto: off, CPU device: torch kernels have nothing to compile"
    )


def _trace_kernels_decision(config: EngineConfig, on_cuda: bool) -> FeatureDecision:
    """``--trace-kernels A:B``: never on unless asked; asked on the CPU is a start-up error."""
    steps = config.tracing.trace_kernel_steps
    if steps is None:
        return FeatureDecision("trace_kernels", False, False, "off unless --trace-kernels A:B")
    if not on_cuda:
        raise ConfigError(
            "trace_kernels=True cannot be honoured: kernel windows record CUPTI kernel activity, "
            f"which needs a CUDA device (device={config.parallel.device!r}); the stage slices of the "
            "CPU device are its whole device timeline"
        )
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError(
            "trace_kernels=True cannot be honoured with tensor_parallel_size > 1 (one profiler "
            "per process; kernel windows are single-rank for now)"
        )
    return FeatureDecision(
        "trace_kernels",
        True,
        True,
        f"CUPTI kernels of steps {steps[0]}..{steps[1] - 1} via torch.profiler (device activity only)",
    )
