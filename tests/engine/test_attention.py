"""Paged attention: torch reference vs dense float64 softmax; Triton (interpreter) vs torch."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.attention import paged_attention_torch, paged_attention_triton  # noqa: E402
from engine.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from engine.model.paged_batch import build_attention_metadata  # noqa: E402


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata
    dense_k: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    dense_v: list[torch.Tensor]
    q_lens: list[int]
    seq_lens: list[int]


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int,
    num_padded_tokens: int | None = None,
    num_padded_reqs: int | None = None,
) -> PagedCase:
    """Random K/V for every context position, written into shuffled, non-contiguous blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks stay random garbage
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    block_tables, dense_k, dense_v = [], [], []
    for seq_len, needed in zip(seq_lens, blocks_needed, strict=True):
        blocks = [pool.pop() for _ in range(needed)]
        block_tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(seq_len):
            kv_cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k)
        dense_v.append(v)
    computed = [s - q for s, q in zip(seq_lens, q_lens, strict=True)]
    metadata, _ = build_attention_metadata(
        computed, q_lens, block_tables, block_size, "cpu", num_padded_tokens, num_padded_reqs
    )
    q = torch.randn(metadata.num_tokens, num_heads, head_dim, generator=gen)
    return PagedCase(q, kv_cache, metadata, dense_k, dense_v, q_lens, seq_lens)


def dense_attention_f64(case: PagedCase, scale: float) -> torch.Tensor:
    """Per request causal softmax(q k^T) v in float64 straight from the dense K/V."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    num_heads, num_kv_heads = case.q.shape[1], case.dense_k[0].shape[1]
    group = num_heads // num_kv_heads
    start = 0
    for q_len, seq_len, k, v in zip(
        case.q_lens, case.seq_lens, case.dense_k, case.dense_v, strict=True
    ):
        q = case.q[start : start + q_len].double()  # [q_len, Hq, D]
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[start : start + q_len] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


# (q_lens, seq_lens, Hq, Hkv, D, block_size, padded tokens, padded reqs)
CASES = {
    "decode_gqa": ([1, 1, 1], [5, 17, 33], 4, 2, 16, 16, None, None),
    "decode_mha_bs4": ([1, 1], [9, 3], 2, 2, 16, 4, None, None),
    "varlen_prefill": ([7, 3, 12], [7, 3, 12], 4, 1, 32, 4, None, None),
    "chunked_prefill": ([5, 9], [21, 9], 4, 2, 16, 16, None, None),
    "spec_verify": ([4, 4, 3], [10, 30, 4], 6, 2, 16, 4, None, None),
    "mixed_padded": ([1, 6, 3], [40, 6, 11], 4, 2, 16, 16, 14, 5),
    "decode_padded": ([1, 1, 1], [5, 40, 2], 4, 2, 16, 16, 8, 6),
}


@pytest.mark.parametrize("name", list(CASES))
def test_torch_reference_matches_dense_float64(name: str) -> None:
    q_lens, seq_lens, hq, hkv, d, bs, pad_t, pad_r = CASES[name]
    case = make_case(q_lens, seq_lens, hq, hkv, d, bs, seed=1, num_padded_tokens=pad_t,
                     num_padded_reqs=pad_r)  # fmt: skip
    scale = d**-0.5
    out = paged_attention_torch(case.q, case.kv_cache, case.metadata, scale)
    expected = dense_attention_f64(case, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    num_real = sum(q_lens)
    assert torch.all(out[num_real:] == 0), "padding tokens must get zeros"


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_torch_reference(name: str) -> None:
    q_lens, seq_lens, hq, hkv, d, bs, pad_t, pad_r = CASES[name]
    case = make_case(q_lens, seq_lens, hq, hkv, d, bs, seed=2, num_padded_tokens=pad_t,
                     num_padded_reqs=pad_r)  # fmt: skip
    scale = d**-0.5
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, scale)
    out = paged_attention_triton(case.q, case.kv_cache, case.metadata, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_triton_long_context_several_kv_tiles() -> None:
    """More than one BLOCK_N tile per request and a q block split across programs."""
    case = make_case([20, 1], [70, 45], 4, 2, 16, 16, seed=3)
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, 0.25)
    out = paged_attention_triton(case.q, case.kv_cache, case.metadata, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_kernel_any_tile_width(block_n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel's tuned launch parameters do not change its result: tiles narrower
    than, and wider than, a KV block, either grid order; padding tokens (past the 3 real ones) come out zero even
    when the output buffer starts as NaN."""
    from engine.kernels.attention import paged_decode_attention_triton

    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))

    case = make_case([1, 1, 1], [70, 1, 33], 4, 2, 16, 16, seed=5, num_padded_tokens=6,
                     num_padded_reqs=4)  # fmt: skip
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, 0.25)
    out = paged_decode_attention_triton(case.q, case.kv_cache, case.metadata, 0.25,
                                        block_n=block_n, num_warps=2, num_stages=3,
                                        head_major=block_n == 64)  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[3:] == 0)


def test_reference_detects_wrong_block_table() -> None:
    """The comparison can fail: pointing the table at a spare (garbage) block changes the result."""
    case = make_case([1], [40], 2, 2, 16, 16, seed=4)
    table = case.metadata.block_table.clone()
    spare = sorted(set(range(case.kv_cache.shape[1])) - set(table[0].tolist()))[0]
    table[0, 1] = spare
    broken = AttentionMetadata(
        case.metadata.query_start_loc, case.metadata.seq_lens, table,
        case.metadata.slot_mapping, case.metadata.num_reqs, case.metadata.num_tokens,
        case.metadata.max_query_len, case.metadata.max_seq_len,
    )  # fmt: skip
    out = paged_attention_torch(case.q, case.kv_cache, broken, 0.25)
    assert not torch.allclose(out.double(), dense_attention_f64(case, 0.25), atol=1e-3)


# Varlen kernel launches: (BLOCK_M, BLOCK_N, SMALL_M, SMALL_N, reverse, head_major). Small tiles, so the
# test batch spans several q blocks per request, full (unmasked) KV tiles before the diagonal
# ones, and requests on the small-tile path (SMALL_M // group tokens or fewer) and off it.
VARLEN_LAUNCHES = {
    "tiles16_reverse": (16, 16, 16, 16, True, False),
    "tiles32x16_small32_head_major": (32, 16, 32, 32, False, True),
    "no_small_path_head_major_reverse": (16, 32, 0, 16, True, True),
}


@pytest.mark.parametrize("name", list(VARLEN_LAUNCHES))
def test_varlen_kernel_any_launch_matches_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, a 3-token verify, prompts of several q blocks and a chunk after 30 cached
    tokens, padded to 56 tokens / 7 requests: real rows equal the torch reference and padding
    rows are 0 even when the output buffer starts as NaN (the kernel writes every row)."""
    block_m, block_n, small_m, small_n, reverse, head_major = VARLEN_LAUNCHES[name]
    launch = {"BLOCK_M": block_m, "BLOCK_N": block_n, "SMALL_M": small_m, "SMALL_N": small_n,
              "num_warps": 4, "num_stages": 2, "reverse": reverse, "head_major": head_major}  # fmt: skip
    case = make_case([1, 19, 3, 1, 11], [40, 19, 9, 1, 41], 4, 2, 16, 4, seed=6,
                     num_padded_tokens=56, num_padded_reqs=7)  # fmt: skip
    _check_varlen_writes_every_row(case, launch, monkeypatch)


def _check_varlen_writes_every_row(
    case: PagedCase, launch: dict, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """The varlen launch on ``case`` with outputs that start as NaN: real rows equal the torch
    reference, padding rows are 0. Returns the output."""
    from engine.kernels.attention import paged_varlen_attention_triton

    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, 0.25)
    out = paged_varlen_attention_triton(case.q, case.kv_cache, case.metadata, 0.25, launch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[sum(case.q_lens) :] == 0)
    return out


@pytest.mark.parametrize("small_m", [16, 0])
def test_varlen_split_decodes_matches_torch(small_m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``split_decodes``: the decode kernel attends the one-token requests (at their own token
    rows, between longer ones) and the varlen kernel the rest; together they write every row,
    padding included (the output starts as NaN), and equal the torch reference."""
    launch = {"BLOCK_M": 16, "BLOCK_N": 16, "SMALL_M": small_m, "SMALL_N": 16, "num_warps": 4,
              "num_stages": 2, "reverse": True, "split_decodes": True}  # fmt: skip
    q_lens, seq_lens = [1, 19, 1, 3, 1, 11, 1], [40, 19, 7, 9, 1, 41, 23]
    case = make_case(q_lens, seq_lens, 4, 2, 16, 4, seed=8, num_padded_tokens=48,
                     num_padded_reqs=9)  # fmt: skip
    out = _check_varlen_writes_every_row(case, launch, monkeypatch)
    dense = dense_attention_f64(case, 0.25)[: sum(q_lens)]
    torch.testing.assert_close(out[: sum(q_lens)].double(), dense, rtol=1e-4, atol=1e-4)


def test_varlen_kernel_odd_group_and_head_dim() -> None:
    """GQA group 3 (rows of a tile not filled by whole tokens) and head_dim 24 (a masked
    head-dim tail, also on the unmasked KV tiles)."""
    from engine.kernels.attention import paged_varlen_attention_triton

    case = make_case([9, 1, 20], [30, 17, 20], 6, 2, 24, 16, seed=7, num_padded_tokens=33)
    launch = {"BLOCK_M": 16, "BLOCK_N": 16, "SMALL_M": 16, "SMALL_N": 16, "num_warps": 4,
              "num_stages": 2, "reverse": False}  # fmt: skip
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, 0.2)
    out = paged_varlen_attention_triton(case.q, case.kv_cache, case.metadata, 0.2, launch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[30:] == 0)


def test_varlen_launch_table_falls_back_when_an_entry_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table entry that cannot launch (the interpreter accepts any tile size, so here one
    missing its KV tile keys) warns, is replaced by the fallback launch, and the result is
    still right."""
    from engine.kernels import attention

    bad = {"BLOCK_M": 64, "num_warps": 4}
    monkeypatch.setitem(attention.VARLEN_LAUNCH, 4, bad)
    case = make_case([5, 1], [12, 7], 4, 2, 16, 4, seed=8)
    expected = paged_attention_torch(case.q, case.kv_cache, case.metadata, 0.25)
    with pytest.warns(RuntimeWarning, match="varlen attention launch"):
        out = attention.paged_varlen_attention_triton(case.q, case.kv_cache, case.metadata, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert attention.VARLEN_LAUNCH[4] == attention.VARLEN_FALLBACK
