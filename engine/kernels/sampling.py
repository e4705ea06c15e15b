"""Sampling kernels: Gumbel-max sampling over the vocab and a per-row logsumexp.

Each op has a torch reference (``*_torch``), a Triton version (``*_triton``) and a dispatcher.
The Triton noise uses exactly the integer hash of :mod:`engine.kernels.noise`, so both versions see
the same uniforms and pick the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels import noise

try:  # Triton is optional: the engine must import without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "SampleCommitArgs",
    "sample_commit_torch",
    "sample_commit_triton",
    "gumbel_sample_torch",
    "gumbel_sample_triton",
    "row_logsumexp_torch",
    "row_logsumexp_triton",
]

SAMPLE_BLOCK = 1024
LSE_BLOCK = 1024


def gumbel_sample_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keep_threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = noise.NoiseStream.SAMPLE,
) -> torch.Tensor:
    """Gumbel-max: token = argmax_v (l_v / T + g_v) over {v : l_v / T >= threshold}.

    With g_v i.i.d. standard Gumbel, P(token = v) = softmax(l / T)_v restricted to the kept set,
    renormalised (the Gumbel-max trick). Rows with T == 0 take argmax_v l_v (greedy, no noise).

    logits: [N, V] f32; temperature: [N] f32; keep_threshold: [N] f32 in scaled-logit units
    (-inf keeps everything); seeds, positions: [N] int64, the noise key with ``stream``.
    Returns [N] int64.
    """
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    # scaled: [N, V]
    scaled = logits / safe_t[:, None]
    key1, key2 = noise.noise_row_keys(seeds, positions, stream)
    uniform = noise.uniform_from_row_keys(key1, key2, logits.shape[1])
    gumbel = -torch.log(-torch.log(uniform))
    neg_inf = torch.full_like(scaled, float("-inf"))
    score = torch.where(scaled >= keep_threshold[:, None], scaled + gumbel, neg_inf)
    score = torch.where(greedy[:, None], logits, score)
    return score.argmax(dim=-1)


@dataclass(frozen=True)
class SampleCommitArgs:
    """One plain sampling step (no penalties) read from and committed to the state table.

    Logits row ``j`` samples for state row ``logit_rows[j]`` (its temperature and seed are read
    there) at position ``p_j = positions[logits_indices[j]] + 1``; the token goes to
    ``last_sampled[commit_rows[j]]`` and ``token_ids[commit_rows[j], min(p_j, L - 1)]``
    (``commit_rows[j]`` is the trash row when the sample is discarded).
    """

    logits: torch.Tensor  # [N, V] f32
    logit_rows: torch.Tensor  # [N] int32/int64 state rows
    commit_rows: torch.Tensor  # [N] int32/int64 state rows (trash = discard)
    logits_indices: torch.Tensor  # [N] int64: token index of each logits row
    positions: torch.Tensor  # [>= T] int64: the step's token positions
    temperature: torch.Tensor  # [R + 1] f32, the state table's column (may be strided)
    seeds: torch.Tensor  # [R + 1] int64, the state table's column (may be strided)
    keep_threshold: torch.Tensor | None  # [N] f32 scaled-logit threshold; None: keep all
    last_sampled: torch.Tensor  # [R + 1] int64, written
    token_ids: torch.Tensor  # [R + 1, L] int64, written
    all_greedy: bool  # host flag: every row has temperature 0 (argmax, no noise)
    stream: int = noise.NoiseStream.SAMPLE


def sample_commit_torch(a: SampleCommitArgs) -> torch.Tensor:
    """Reference: gather, Gumbel-max (or argmax), commit, as separate torch ops. [N] int64."""
    commit = a.commit_rows.long()  # [N]
    positions = a.positions[a.logits_indices] + 1  # [N]
    if a.all_greedy:
        sampled = a.logits.argmax(dim=-1)
    else:
        rows = a.logit_rows.long()  # [N]
        threshold = a.keep_threshold
        if threshold is None:
            threshold = torch.full_like(a.temperature[rows], float("-inf"))
        sampled = gumbel_sample_torch(
            a.logits, a.temperature[rows], threshold, a.seeds[rows], positions, a.stream
        )
    a.last_sampled[commit] = sampled
    a.token_ids[commit, positions.clamp(max=a.token_ids.shape[1] - 1)] = sampled
    return sampled


def row_logsumexp_torch(logits: torch.Tensor) -> torch.Tensor:
    """log sum_v exp(l_v) per row. logits: [N, V] f32 -> [N] f32."""
    return torch.logsumexp(logits, dim=-1)


if HAS_TRITON:

    @triton.jit
    def _mul32(x, lo: tl.constexpr, hi: tl.constexpr):
        # x * (hi * 2**16 + lo) mod 2**32 for x in [0, 2**32) held in int64 (see noise._mul32).
        return (x * lo + (((x * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _mix32(x):
        # lowbias32; constants 0x7FEB352D and 0x846CA68B split into 16-bit halves.
        x = x ^ (x >> 16)
        x = _mul32(x, 0x352D, 0x7FEB)
        x = x ^ (x >> 15)
        x = _mul32(x, 0xA68B, 0x846C)
        return x ^ (x >> 16)

    @triton.jit
    def _mix32_u32(x):
        # _mix32 on native uint32 lanes: a uint32 multiply wraps mod 2**32, so this is the same
        # function without int64 arithmetic (which the GPU emulates with several 32-bit ops): the
        # per-element hash, run V times per row, is the random path's main cost.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _row_key(init: tl.constexpr, seed, position):
        # noise._chain for one row: init = (KEY*_INIT + stream) mod 2**32, then the four words.
        h = _mix32(tl.full((), init, tl.int64))
        h = _mix32(h ^ (seed & 0xFFFFFFFF))
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
        h = _mix32(h ^ (position & 0xFFFFFFFF))
        return _mix32(h ^ ((position >> 32) & 0xFFFFFFFF))

    @triton.jit
    def _gumbel_span(row_ptr, lo, hi, vocab_size, temp, threshold, key1, key2, BLOCK: tl.constexpr):
        # (max, argmax) over v in [lo, hi) of x_v / T + g_v, kept where x_v / T >= threshold
        # (x_v when T == 0). One span is the whole row here and one vocab chunk in the split path
        # (engine/kernels/sampling_split.py): both score every element with this same code.
        greedy = temp == 0.0
        safe_t = tl.where(greedy, 1.0, temp)
        k1 = key1.to(tl.uint32)  # the row keys are in [0, 2**32): exact
        k2 = key2.to(tl.uint32)
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            in_vocab = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
            scaled = tl.div_rn(x, safe_t)  # IEEE division, as torch's
            h = _mix32_u32(_mix32_u32(offs.to(tl.uint32) ^ k1) ^ k2)
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
            gumbel = -tl.log(-tl.log(u))
            score = tl.where(scaled >= threshold, scaled + gumbel, float("-inf"))
            score = tl.where(greedy, x, score)
            score = tl.where(in_vocab, score, float("-inf"))
            block_max = tl.max(score, axis=0)
            block_idx = tl.argmax(score, axis=0)
            better = block_max > best_val  # strict: ties keep the first index, like torch
            best_idx = tl.where(better, start + block_idx, best_idx)
            best_val = tl.where(better, block_max, best_val)
        return best_val, best_idx

    @triton.jit
    def _gumbel_argmax(row_ptr, vocab_size, temp, threshold, key1, key2, BLOCK: tl.constexpr):
        # argmax_v (x_v / T + g_v) over {x_v / T >= threshold}; argmax_v x_v when T == 0.
        _, best_idx = _gumbel_span(
            row_ptr, 0, vocab_size, vocab_size, temp, threshold, key1, key2, BLOCK
        )
        return best_idx

    @triton.jit
    def _argmax_span(row_ptr, lo, hi, vocab_size, BLOCK: tl.constexpr):
        # (max, argmax) of x_v over v in [lo, hi), the first index among ties (torch's rule).
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf"))
            x = x.to(tl.float32)
            block_max = tl.max(x, axis=0)
            block_idx = tl.argmax(x, axis=0)
            better = block_max > best_val
            best_idx = tl.where(better, start + block_idx, best_idx)
            best_val = tl.where(better, block_max, best_val)
        return best_val, best_idx

    @triton.jit
    def _argmax_row(row_ptr, vocab_size, BLOCK: tl.constexpr):
        # argmax_v x_v, the first index among ties (torch.argmax's rule).
        _, best_idx = _argmax_span(row_ptr, 0, vocab_size, vocab_size, BLOCK)
        return best_idx

    @triton.jit
    def _row_noise_params(
        j,
        state_rows_ptr,
        logits_indices_ptr,
        positions_ptr,
        temperature_ptr,
        temperature_stride,
        seeds_ptr,
        seeds_stride,
        threshold_ptr,
        KEY1_INIT: tl.constexpr,
        KEY2_INIT: tl.constexpr,
        HAS_THRESHOLD: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        # (T, threshold, key1, key2) of logits row j. INDIRECT (sample + commit): the parameters
        # live in state row state_rows[j], the noise position is positions[logits_indices[j]] + 1;
        # else (gumbel_sample) they are row j's and the position is positions[j].
        if INDIRECT:
            token = tl.load(logits_indices_ptr + j).to(tl.int64)
            position = tl.load(positions_ptr + token).to(tl.int64) + 1
            state_row = tl.load(state_rows_ptr + j).to(tl.int64)
        else:
            position = tl.load(positions_ptr + j).to(tl.int64)
            state_row = j.to(tl.int64)
        temp = tl.load(temperature_ptr + state_row * temperature_stride)
        seed = tl.load(seeds_ptr + state_row * seeds_stride).to(tl.int64)
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + j)
        else:
            threshold = tl.full((), float("-inf"), tl.float32)
        key1 = _row_key(KEY1_INIT, seed, position)
        key2 = _row_key(KEY2_INIT, seed, position)
        return temp, threshold, key1, key2

    @triton.jit
    def _commit_sampled(
        j, sampled, commit_rows_ptr, logits_indices_ptr, positions_ptr, last_sampled_ptr,
        token_ids_ptr, token_ids_stride, max_model_len,
    ):  # fmt: skip
        # Commit logits row j's token: last_sampled and token_ids at the position it occupies
        # (the row's token position + 1, clamped to the table).
        token = tl.load(logits_indices_ptr + j).to(tl.int64)
        position = tl.load(positions_ptr + token).to(tl.int64) + 1
        commit_row = tl.load(commit_rows_ptr + j).to(tl.int64)
        tl.store(last_sampled_ptr + commit_row, sampled)
        column = tl.minimum(position, max_model_len - 1)
        tl.store(token_ids_ptr + commit_row * token_ids_stride + column, sampled)

    @triton.jit
    def _gumbel_sample_kernel(
        logits_ptr,
        logits_stride,
        temperature_ptr,
        threshold_ptr,
        seeds_ptr,
        positions_ptr,
        out_ptr,
        vocab_size,
        KEY1_INIT: tl.constexpr,  # compile-time: a runtime u32 argument would not widen exactly
        KEY2_INIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        temp, threshold, key1, key2 = _row_noise_params(
            row, row, row, positions_ptr, temperature_ptr, 1, seeds_ptr, 1, threshold_ptr,
            KEY1_INIT, KEY2_INIT, True, False,
        )  # fmt: skip
        row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
        best_idx = _gumbel_argmax(row_ptr, vocab_size, temp, threshold, key1, key2, BLOCK)
        tl.store(out_ptr + row, best_idx.to(tl.int64))

    @triton.jit
    def _sample_commit_kernel(
        logits_ptr,
        logits_stride,
        logit_rows_ptr,
        commit_rows_ptr,
        logits_indices_ptr,
        positions_ptr,
        temperature_ptr,
        temperature_stride,
        seeds_ptr,
        seeds_stride,
        threshold_ptr,
        out_ptr,
        last_sampled_ptr,
        token_ids_ptr,
        token_ids_stride,
        max_model_len,
        vocab_size,
        KEY1_INIT: tl.constexpr,
        KEY2_INIT: tl.constexpr,
        ALL_GREEDY: tl.constexpr,  # no noise hashed at all
        HAS_THRESHOLD: tl.constexpr,  # False: keep every token
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0)
        row_ptr = logits_ptr + j.to(tl.int64) * logits_stride
        if ALL_GREEDY:
            best_idx = _argmax_row(row_ptr, vocab_size, BLOCK)
        else:
            temp, threshold, key1, key2 = _row_noise_params(
                j, logit_rows_ptr, logits_indices_ptr, positions_ptr, temperature_ptr,
                temperature_stride, seeds_ptr, seeds_stride, threshold_ptr,
                KEY1_INIT, KEY2_INIT, HAS_THRESHOLD, True,
            )  # fmt: skip
            best_idx = _gumbel_argmax(row_ptr, vocab_size, temp, threshold, key1, key2, BLOCK)
        sampled = best_idx.to(tl.int64)
        tl.store(out_ptr + j, sampled)
        _commit_sampled(
            j, sampled, commit_rows_ptr, logits_indices_ptr, positions_ptr, last_sampled_ptr,
            token_ids_ptr, token_ids_stride, max_model_len,
        )  # fmt: skip

    @triton.jit
    def _row_logsumexp_kernel(logits_ptr, logits_stride, out_ptr, vocab_size, BLOCK: tl.constexpr):
        # Online logsumexp: keep (m, s) with s = sum exp(l - m), rescaled when m grows.
        row = tl.program_id(0)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(
                logits_ptr + row.to(tl.int64) * logits_stride + offs,
                mask=offs < vocab_size,
                other=float("-inf"),
            )
            new_m = tl.maximum(m, tl.max(x, axis=0))
            safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
            s = s * tl.exp(m - safe_m) + tl.sum(tl.exp(x - safe_m), axis=0)
            m = new_m
        # A row of only -inf has s = 0; log(1) keeps the unused branch finite.
        lse = m + tl.log(tl.where(s > 0.0, s, 1.0))
        tl.store(out_ptr + row, tl.where(m == float("-inf"), m, lse))


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use the torch kernel backend")


def gumbel_sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keep_threshold: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: int = noise.NoiseStream.SAMPLE,
    block: int = SAMPLE_BLOCK,
) -> torch.Tensor:
    """Triton version of :func:`gumbel_sample_torch`: one program per row, one pass over V;
    the row keys are hashed in the kernel too, so the whole step is one launch."""
    _require_triton()
    num_rows, vocab_size = logits.shape
    logits = logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    block = min(block, triton.next_power_of_2(vocab_size))
    _gumbel_sample_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        temperature.contiguous(),
        keep_threshold.contiguous(),
        seeds.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(),
        out,
        vocab_size,
        KEY1_INIT=(noise.KEY1_INIT + int(stream)) & noise.MASK32,
        KEY2_INIT=(noise.KEY2_INIT + int(stream)) & noise.MASK32,
        BLOCK=block,
    )
    return out


def sample_commit_triton(a: SampleCommitArgs, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """Triton version of :func:`sample_commit_torch`: one program per logits row reads its
    parameters from the state table, samples in one pass over V and commits: one launch."""
    _require_triton()
    num_rows, vocab_size = a.logits.shape
    logits = a.logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    threshold = a.keep_threshold
    block = min(block, triton.next_power_of_2(vocab_size))
    _sample_commit_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        a.logit_rows,
        a.commit_rows,
        a.logits_indices,
        a.positions,
        a.temperature,
        a.temperature.stride(0),
        a.seeds,
        a.seeds.stride(0),
        out if threshold is None else threshold.contiguous(),  # unread without a threshold
        out,
        a.last_sampled,
        a.token_ids,
        a.token_ids.stride(0),
        a.token_ids.shape[1],
        vocab_size,
        KEY1_INIT=(noise.KEY1_INIT + int(a.stream)) & noise.MASK32,
        KEY2_INIT=(noise.KEY2_INIT + int(a.stream)) & noise.MASK32,
        ALL_GREEDY=a.all_greedy,
        HAS_THRESHOLD=threshold is not None,
        BLOCK=block,
    )
    return out


def row_logsumexp_triton(logits: torch.Tensor, block: int = LSE_BLOCK) -> torch.Tensor:
    """Triton version of :func:`row_logsumexp_torch`: one program per row, online rescaling."""
    _require_triton()
    num_rows, vocab_size = logits.shape
    logits = logits.contiguous()
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    block = min(block, triton.next_power_of_2(vocab_size))
    _row_logsumexp_kernel[(num_rows,)](logits, logits.stride(0), out, vocab_size, BLOCK=block)
    return out
