"""Applying a packed token bitmask to logits on the device, before the sampler sees them.

The bitmask is xgrammar's layout: ``int32 [N, ceil(V / 32)]``; token ``v`` of row ``i`` is allowed
iff bit ``v % 32`` of word ``bitmask[i, v // 32]`` is set. A disallowed token's logit becomes
``-inf``, so greedy argmax, Gumbel-max, top-k/top-p and the rejection sampler's ``p(d)`` all see
probability 0 for it. Rows of requests without a grammar carry all bits set (``-1``): unchanged.

``apply_token_bitmask_torch`` is the reference; ``apply_token_bitmask_triton`` is one program per
(row, vocab block); the kernel backend (`engine.kernels.backend`) picks one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # the engine runs without triton; only the torch path is then available
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = [
    "BITS_PER_WORD",
    "num_bitmask_words",
    "check_bitmask",
    "apply_token_bitmask_torch",
    "apply_token_bitmask_triton",
]

BITS_PER_WORD = 32
_BLOCK = 1024  # a multiple of 32: one block never splits a word


def num_bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // BITS_PER_WORD)


# stepscope: hot
def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Reference: ``logits[i, v] = -inf`` where bit ``v`` of row ``i`` is 0; in place, returned.

    logits: [N, V] float; bitmask: [N, ceil(V / 32)] int32 on the same device.
    """
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask[:num_rows, :, None] >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size].bool()  # [N, V]
    return logits.masked_fill_(~allowed, float("-inf"))


@functools.cache
def _build_kernel() -> Any:
    """Define the kernel on first use, so TRITON_INTERPRET set by then is honoured."""

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr,
        logits_stride,
        bitmask_ptr,
        bitmask_stride,
        vocab_size,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = offs < vocab_size
        words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=in_vocab, other=-1)
        allowed = ((words >> (offs % 32)) & 1) != 0
        neg_inf = tl.full((BLOCK,), float("-inf"), tl.float32)
        dst = logits_ptr + row * logits_stride + offs
        tl.store(dst, neg_inf.to(dst.dtype.element_ty), mask=in_vocab & ~allowed)

    return _apply_bitmask_kernel


# stepscope: hot
def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Triton: same contract as :func:`apply_token_bitmask_torch` (last dims contiguous)."""
    if triton is None:
        raise RuntimeError("apply_token_bitmask_triton needs triton, which is not installed")
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK))
    _build_kernel()[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), vocab_size, BLOCK=_BLOCK
    )
    return logits


def check_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``bitmask`` has ``ceil(V / 32)`` words per row for
    ``logits: [N, V]``."""
    if bitmask.shape[1] != num_bitmask_words(logits.shape[1]):
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words per row, vocab {logits.shape[1]} needs "
            f"{num_bitmask_words(logits.shape[1])}"
        )
