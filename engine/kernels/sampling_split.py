"""Split-vocab sampling kernels: a (rows x vocab chunks) grid, then one reduction per row.

The one-program-per-row kernels of :mod:`engine.kernels.sampling` walk a row's whole vocab
serially: at batch 256 and V = 151,936 that is 256 programs on 132 SMs, each a long dependent
loop, and the step's sampling took ~131 us on the H200 for a logits read worth ~20-40 us of
bandwidth (docs/design.md §2.15, issue 17). Here stage 1 runs one program per (row, chunk of
``chunk`` tokens) and writes that chunk's partial; stage 2 runs one program per row, reduces the
row's partials and stores (and, for :func:`sample_commit_split_triton`, commits) the result.

Both reductions decompose over chunks exactly:

* **Gumbel-max / argmax**: the token is ``argmax_v score_v`` with ``score_v = l_v / T + g_v`` over
  the kept set (``l_v`` when T = 0). Stage 1 keeps ``(max_c, argmax_c)`` per chunk, scoring every
  element with the same code as the per-row kernel (``sampling._gumbel_span``: the same division,
  hash, noise and threshold); stage 2 takes the max of the ``max_c`` and, among equal maxima, the
  first chunk. A max is exact in floating point and a chunk's argmax is its first index among ties,
  so the token is the first index of the row's maximum: the same token as the per-row kernel and
  ``torch.argmax``, bit for bit, for every seed.
* **logsumexp**: stage 1 keeps ``(m_c, s_c)`` with ``s_c = sum_{v in c} exp(l_v - m_c)``;
  stage 2: ``M = max_c m_c``, ``lse = M + log sum_c s_c exp(m_c - M)`` (equal to the per-row
  online kernel up to fp32 rounding, not bit for bit: the sums are grouped differently).

CUDA-graph safe like the per-row kernels: the grids and the partial buffers' shapes depend only on
the host shapes ``(N, V)`` and the launch constants, and nothing reads a device value on the host.
"""

from __future__ import annotations

import torch

from engine.kernels import noise
from engine.kernels.sampling import HAS_TRITON, SampleCommitArgs

if HAS_TRITON:
    import triton
    import triton.language as tl

    from engine.kernels.sampling import (
        _argmax_span,
        _commit_sampled,
        _gumbel_span,
        _row_noise_params,
    )

__all__ = [
    "SPLIT_BLOCK",
    "SPLIT_CHUNK",
    "SPLIT_WARPS",
    "check_split_launch",
    "gumbel_sample_split_triton",
    "row_logsumexp_split_triton",
    "sample_commit_split_triton",
    "split_applies",
]

# Launch defaults: tokens per stage-1 program, the block each of its loop steps loads, its warps.
# bench/bench_sample_kernel.py's sweep on the H200 (bench/README.md, issue 17): best overall,
# 1.04x of each measured case's best.
SPLIT_CHUNK = 4096
SPLIT_BLOCK = 1024
SPLIT_WARPS = 4


def split_applies(vocab_size: int, chunk: int = SPLIT_CHUNK) -> bool:
    """Whether the split path runs for a vocab: only when it has more than one chunk. With one
    chunk the per-row kernel does the same work in one launch instead of two."""
    return vocab_size > chunk


def check_split_launch(chunk: int, block: int) -> None:
    """ValueError for launch constants the kernels cannot take (``tl.arange`` needs powers of
    two; a chunk must hold whole blocks, so ``block`` is clamped to ``chunk``)."""
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")


def _launch_constants(vocab_size: int, chunk: int, block: int) -> tuple[int, int, int]:
    """``(num_chunks, block, chunks_pow2)`` of one launch."""
    check_split_launch(chunk, block)
    block = min(block, chunk)
    num_chunks = -(-vocab_size // chunk)
    return num_chunks, block, max(2, triton.next_power_of_2(num_chunks))


if HAS_TRITON:

    @triton.jit
    def _sample_partials_kernel(
        logits_ptr,
        logits_stride,
        state_rows_ptr,
        logits_indices_ptr,
        positions_ptr,
        temperature_ptr,
        temperature_stride,
        seeds_ptr,
        seeds_stride,
        threshold_ptr,
        part_val_ptr,  # [N, C] f32
        part_idx_ptr,  # [N, C] int32
        vocab_size,
        num_chunks,
        KEY1_INIT: tl.constexpr,
        KEY2_INIT: tl.constexpr,
        ALL_GREEDY: tl.constexpr,  # argmax, no noise hashed
        HAS_THRESHOLD: tl.constexpr,
        INDIRECT: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0)
        c = tl.program_id(1)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, vocab_size)
        row_ptr = logits_ptr + j.to(tl.int64) * logits_stride
        if ALL_GREEDY:
            best_val, best_idx = _argmax_span(row_ptr, lo, hi, vocab_size, BLOCK)
        else:
            temp, threshold, key1, key2 = _row_noise_params(
                j, state_rows_ptr, logits_indices_ptr, positions_ptr, temperature_ptr,
                temperature_stride, seeds_ptr, seeds_stride, threshold_ptr,
                KEY1_INIT, KEY2_INIT, HAS_THRESHOLD, INDIRECT,
            )  # fmt: skip
            best_val, best_idx = _gumbel_span(
                row_ptr, lo, hi, vocab_size, temp, threshold, key1, key2, BLOCK
            )
        tl.store(part_val_ptr + j * num_chunks + c, best_val)
        tl.store(part_idx_ptr + j * num_chunks + c, best_idx)

    @triton.jit
    def _reduce_commit_kernel(
        part_val_ptr,
        part_idx_ptr,
        num_chunks,
        out_ptr,
        commit_rows_ptr,
        logits_indices_ptr,
        positions_ptr,
        last_sampled_ptr,
        token_ids_ptr,
        token_ids_stride,
        max_model_len,
        COMMIT: tl.constexpr,  # also write last_sampled / token_ids (sample_commit)
        CHUNKS: tl.constexpr,  # num_chunks rounded up to a power of two
    ):
        j = tl.program_id(0)
        offs = tl.arange(0, CHUNKS)
        live = offs < num_chunks
        vals = tl.load(part_val_ptr + j * num_chunks + offs, mask=live, other=float("-inf"))
        idxs = tl.load(part_idx_ptr + j * num_chunks + offs, mask=live, other=0)
        # tl.argmax keeps the first among equal maxima: the lowest chunk, whose own argmax is its
        # first index, so the row's first maximum wins (torch's tie rule). All -inf: chunk 0,
        # whose partial index is then 0, as the per-row kernel returns.
        best = tl.argmax(vals, axis=0)
        sampled = tl.sum(tl.where(offs == best, idxs, 0), axis=0).to(tl.int64)
        tl.store(out_ptr + j, sampled)
        if COMMIT:
            _commit_sampled(
                j, sampled, commit_rows_ptr, logits_indices_ptr, positions_ptr, last_sampled_ptr,
                token_ids_ptr, token_ids_stride, max_model_len,
            )  # fmt: skip

    @triton.jit
    def _lse_partials_kernel(
        logits_ptr,
        logits_stride,
        part_m_ptr,  # [N, C] f32: the chunk's max
        part_s_ptr,  # [N, C] f32: sum exp(l - max) over the chunk
        vocab_size,
        num_chunks,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0)
        c = tl.program_id(1)
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, vocab_size)
        row_ptr = logits_ptr + j.to(tl.int64) * logits_stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)
            m = new_m
        tl.store(part_m_ptr + j * num_chunks + c, m)
        tl.store(part_s_ptr + j * num_chunks + c, s)

    @triton.jit
    def _lse_reduce_kernel(part_m_ptr, part_s_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
        # lse = M + log sum_c s_c exp(m_c - M); chunks of only -inf have s_c = 0 and add nothing.
        j = tl.program_id(0)
        offs = tl.arange(0, CHUNKS)
        live = offs < num_chunks
        m = tl.load(part_m_ptr + j * num_chunks + offs, mask=live, other=float("-inf"))
        s = tl.load(part_s_ptr + j * num_chunks + offs, mask=live, other=0.0)
        big_m = tl.max(m, axis=0)
        safe_m = tl.where(big_m == float("-inf"), 0.0, big_m)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - safe_m)), axis=0)
        lse = big_m + tl.log(tl.where(total > 0.0, total, 1.0))
        tl.store(out_ptr + j, tl.where(big_m == float("-inf"), big_m, lse))


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch kernel backend")


def _partials(num_rows: int, num_chunks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One allocation for both partials: ``(values [N, C] f32, indices [N, C] int32)``."""
    buf = torch.empty((2, num_rows, num_chunks), dtype=torch.int32, device=device)
    return buf[0].view(torch.float32), buf[1]


def sample_commit_split_triton(
    a: SampleCommitArgs,
    chunk: int = SPLIT_CHUNK,
    block: int = SPLIT_BLOCK,
    num_warps: int = SPLIT_WARPS,
) -> torch.Tensor:
    """Split-vocab :func:`engine.kernels.sampling.sample_commit_torch`: the same tokens and the
    same commit, in two launches (partials over a ``(N, ceil(V / chunk))`` grid, then one
    reduce-and-commit program per row). ``[N]`` int64."""
    _require_triton()
    num_rows, vocab_size = a.logits.shape
    logits = a.logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks, block, chunks_pow2 = _launch_constants(vocab_size, chunk, block)
    part_val, part_idx = _partials(num_rows, num_chunks, logits.device)
    threshold = a.keep_threshold
    _sample_partials_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), a.logit_rows, a.logits_indices, a.positions,
        a.temperature, a.temperature.stride(0), a.seeds, a.seeds.stride(0),
        out if threshold is None else threshold.contiguous(),  # unread without a threshold
        part_val, part_idx, vocab_size, num_chunks,
        KEY1_INIT=(noise.KEY1_INIT + int(a.stream)) & noise.MASK32,
        KEY2_INIT=(noise.KEY2_INIT + int(a.stream)) & noise.MASK32,
        ALL_GREEDY=a.all_greedy, HAS_THRESHOLD=threshold is not None, INDIRECT=True,
        CHUNK=chunk, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    _reduce_commit_kernel[(num_rows,)](
        part_val, part_idx, num_chunks, out, a.commit_rows, a.logits_indices, a.positions,
        a.last_sampled, a.token_ids, a.token_ids.stride(0), a.token_ids.shape[1],
        COMMIT=True, CHUNKS=chunks_pow2, num_warps=1,
    )  # fmt: skip
    return out


def gumbel_sample_split_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keep_threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = noise.NoiseStream.SAMPLE,
    chunk: int = SPLIT_CHUNK,
    block: int = SPLIT_BLOCK,
    num_warps: int = SPLIT_WARPS,
) -> torch.Tensor:
    """Split-vocab :func:`engine.kernels.sampling.gumbel_sample_torch` (the penalised sampler,
    spec verify's recovery and the draft proposers call it): the same tokens. ``[N]`` int64."""
    _require_triton()
    num_rows, vocab_size = logits.shape
    logits = logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks, block, chunks_pow2 = _launch_constants(vocab_size, chunk, block)
    part_val, part_idx = _partials(num_rows, num_chunks, logits.device)
    positions = positions.to(torch.int64).contiguous()
    _sample_partials_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), out, out, positions,  # no state rows / logits indices
        temperature.contiguous(), 1, seeds.to(torch.int64).contiguous(), 1,
        keep_threshold.contiguous(), part_val, part_idx, vocab_size, num_chunks,
        KEY1_INIT=(noise.KEY1_INIT + int(stream)) & noise.MASK32,
        KEY2_INIT=(noise.KEY2_INIT + int(stream)) & noise.MASK32,
        ALL_GREEDY=False, HAS_THRESHOLD=True, INDIRECT=False,
        CHUNK=chunk, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    _reduce_commit_kernel[(num_rows,)](
        part_val, part_idx, num_chunks, out, out, out, out, out, out, 0, 1,  # no commit
        COMMIT=False, CHUNKS=chunks_pow2, num_warps=1,
    )  # fmt: skip
    return out


def row_logsumexp_split_triton(
    logits: torch.Tensor,
    chunk: int = SPLIT_CHUNK,
    block: int = SPLIT_BLOCK,
    num_warps: int = SPLIT_WARPS,
) -> torch.Tensor:
    """Split-vocab :func:`engine.kernels.sampling.row_logsumexp_torch` (logprobs' normaliser):
    ``logits: [N, V]`` -> ``[N]`` f32, equal up to fp32 rounding."""
    _require_triton()
    num_rows, vocab_size = logits.shape
    logits = logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks, block, chunks_pow2 = _launch_constants(vocab_size, chunk, block)
    parts = torch.empty((2, num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    _lse_partials_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), parts[0], parts[1], vocab_size, num_chunks,
        CHUNK=chunk, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    _lse_reduce_kernel[(num_rows,)](parts[0], parts[1], out, num_chunks, CHUNKS=chunks_pow2)
    return out
