"""How many KV cache blocks the engine gets (docs/design.md §2.13): the arithmetic, once.

On a CUDA device with ``num_kv_blocks`` left to auto, the KV cache takes what is left of
``gpu_memory_utilization x total`` device memory (vLLM's meaning) after everything else the engine
and the other processes hold or will hold at the peak::

    kv_bytes   = utilization * total - (total - free) - runner - graphs - peak_activation
    num_blocks = floor(kv_bytes / bytes_per_block)

``free`` is measured (``torch.cuda.mem_get_info``) after the weights are loaded and before the
runner exists, so ``total - free`` holds the weights, this process's CUDA context and every other
process's memory. ``runner`` (persistent step buffers and the request state table), ``graphs``
(the CUDA graph pool) and ``peak_activation`` (the largest temporaries of a profiling step at
``max_num_batched_tokens`` tokens with the sampler at ``max_num_seqs`` rows) are measured on a
probe runner (``engine.memory_profile``). Everything here is pure arithmetic on those numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ConfigError

__all__ = [
    "CPU_DEFAULT_NUM_BLOCKS",
    "KvBudget",
    "KvCapacity",
    "kv_budget",
    "max_concurrency",
    "max_useful_blocks",
]

# The CPU device keeps a small fixed pool (16k tokens at block size 16): host memory is shared
# with everything else and CPU runs are tests and smoke checks.
CPU_DEFAULT_NUM_BLOCKS = 1024
_GIB = 2**30


@dataclass(frozen=True)
class KvBudget:
    """The device-memory arithmetic of one rank, every term in bytes (see the module docstring)."""

    total_bytes: int
    free_bytes: int
    weights_bytes: int
    runner_bytes: int
    graph_bytes: int
    peak_activation_bytes: int
    utilization: float
    bytes_per_block: int

    @property
    def usable_bytes(self) -> int:
        """``utilization x total``: what the engine may use, others' memory included."""
        return int(self.utilization * self.total_bytes)

    @property
    def other_bytes(self) -> int:
        """Held before the runner exists, besides the weights: other processes, the CUDA
        context, allocator slack."""
        return max(0, self.total_bytes - self.free_bytes - self.weights_bytes)

    @property
    def kv_bytes(self) -> int:
        """What is left for the KV cache (negative: not even the non-KV parts fit)."""
        used = self.total_bytes - self.free_bytes
        return (
            self.usable_bytes
            - used
            - self.runner_bytes
            - self.graph_bytes
            - self.peak_activation_bytes
        )

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_bytes // self.bytes_per_block)

    def describe(self) -> str:
        """One line with every term, in GiB."""

        def g(n: int) -> str:
            return f"{n / _GIB:.2f}"

        return (
            f"{self.utilization:g} x {g(self.total_bytes)} GiB = {g(self.usable_bytes)} GiB usable"
            f" - weights {g(self.weights_bytes)} - other processes/context "
            f"{g(self.other_bytes)} - runner buffers {g(self.runner_bytes)} - CUDA graphs "
            f"{g(self.graph_bytes)} - peak activation {g(self.peak_activation_bytes)} = KV "
            f"{g(self.kv_bytes)} GiB at {self.bytes_per_block} B per block"
        )


def kv_budget(
    *,
    total_bytes: int,
    free_bytes: int,
    weights_bytes: int,
    peak_activation_bytes: int,
    graph_bytes: int,
    utilization: float,
    bytes_per_block: int,
    runner_bytes: int = 0,
) -> KvBudget:
    """The KV budget of one rank; raises ``ValueError`` on inputs that cannot be memory sizes.

    ``free_bytes`` is the device's free memory with the weights loaded and no runner built;
    ``weights_bytes`` only splits ``total - free`` in the report (it is already inside it)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
    if not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"free_bytes {free_bytes} outside [0, total_bytes={total_bytes}]")
    for name, value in (
        ("weights_bytes", weights_bytes),
        ("peak_activation_bytes", peak_activation_bytes),
        ("graph_bytes", graph_bytes),
        ("runner_bytes", runner_bytes),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if weights_bytes > total_bytes - free_bytes:
        raise ValueError(
            f"weights_bytes {weights_bytes} exceed the used memory total - free = "
            f"{total_bytes - free_bytes} (free must be measured with the weights loaded)"
        )
    return KvBudget(
        total_bytes=total_bytes,
        free_bytes=free_bytes,
        weights_bytes=weights_bytes,
        runner_bytes=runner_bytes,
        graph_bytes=graph_bytes,
        peak_activation_bytes=peak_activation_bytes,
        utilization=utilization,
        bytes_per_block=bytes_per_block,
    )


def max_concurrency(num_blocks: int, block_size: int, tokens_per_request: int) -> float:
    """How many requests of ``tokens_per_request`` tokens (prompt + output) the pool holds at
    once, each rounded up to whole blocks (vLLM's "Maximum concurrency for N tokens per
    request"). An upper bound: prefix sharing raises it, spec lookahead lowers it slightly."""
    if tokens_per_request <= 0:
        raise ValueError(f"tokens_per_request must be > 0, got {tokens_per_request}")
    return num_blocks / math.ceil(tokens_per_request / block_size)


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that ``max_num_seqs`` requests of ``max_model_len`` tokens can hold at once, plus
    as many again for the prefix cache: a measured pool is capped there (a tiny model on a large
    device would otherwise get millions of blocks, each a host object of the block pool)."""
    return 2 * max_num_seqs * math.ceil(max_model_len / block_size)


@dataclass(frozen=True)
class KvCapacity:
    """The resolved KV pool: its size, where the number came from, and the budget behind it.

    ``source``: ``"num_kv_blocks"`` (given explicitly), ``"cpu default"`` or
    ``"gpu_memory_utilization"`` (sized from device memory; ``budget`` set)."""

    num_blocks: int
    block_size: int
    source: str
    budget: KvBudget | None = None
    # Ranks that sized themselves: the pool is the minimum over them (tensor parallelism).
    rank_num_blocks: tuple[int, ...] = ()
    capped_from: int | None = None  # the budget's blocks, when max_useful_blocks capped them

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def concurrency(self, tokens_per_request: int) -> float:
        return max_concurrency(self.num_blocks, self.block_size, tokens_per_request)

    def check_fits(self, max_model_len: int) -> None:
        """A start-up :class:`ConfigError`, with the numbers, when one request of
        ``max_model_len`` tokens does not fit the pool."""
        need = math.ceil(max_model_len / self.block_size)
        if self.num_blocks >= need:
            return
        detail = f" ({self.budget.describe()})" if self.budget is not None else ""
        raise ConfigError(
            f"the KV cache holds {self.num_blocks} blocks x {self.block_size} = "
            f"{self.num_tokens} tokens, less than one request of max_model_len={max_model_len} "
            f"tokens ({need} blocks){detail}; raise --gpu-memory-utilization, lower "
            "--max-model-len, --max-num-batched-tokens or --max-num-seqs, or free device memory"
        )

    def describe(self, max_model_len: int) -> str:
        """The start-up line: blocks, tokens, concurrency at ``max_model_len``, and why."""
        why = {
            "num_kv_blocks": "--num-kv-blocks",
            "cpu default": "the CPU device's default",
            "gpu_memory_utilization": "sized from device memory",
        }.get(self.source, self.source)
        line = (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens} tokens "
            f"({why}); maximum concurrency for {max_model_len} tokens per request: "
            f"{self.concurrency(max_model_len):.2f}x"
        )
        if self.capped_from is not None:
            line += f"; capped from {self.capped_from} (2 x max_num_seqs requests of max_model_len)"
        if len(set(self.rank_num_blocks)) > 1:
            line += f"; the minimum over ranks {list(self.rank_num_blocks)}"
        if self.budget is not None:
            line += f"\n  {self.budget.describe()}"
        return line
