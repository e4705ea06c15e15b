"""bench/_decode_variants.py on the CPU (TRITON_INTERPRET=1): every decode-attention variant
(tensor-core or CUDA-core scores, split segments, persistent programs) against the float32
torch reference, with GQA groups 1/2/4, a padded request, a prefill row and padding tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from bench._decode_variants import decode_variant, item_bounds  # noqa: E402
from engine.kernels.attention import paged_attention_torch  # noqa: E402
from engine.model.paged_batch import build_attention_metadata  # noqa: E402

BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS = 16, 32, 2


def _batch(group: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """Four requests at contexts 1, 37, 70 and 0 (a padded request, query_len 0) plus two
    padding tokens; block tables out of order."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [1, 37, 70]
    blocks = [[7], [2, 5, 0], [1, 3, 6, 4, 8]]
    kv = torch.randn(2, 9, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    md, _ = build_attention_metadata(
        [c - 1 for c in ctx], [1] * 3, blocks, BLOCK_SIZE, "cpu", num_padded_tokens=6,
        num_padded_reqs=4,
    )  # fmt: skip
    q = torch.randn(6, NUM_KV_HEADS * group, HEAD_DIM, generator=gen)
    return q, kv, md


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    ("dot", "splits", "programs"),
    [(True, 1, 0), (False, 1, 0), (False, 2, 0), (True, 4, 0), (False, 1, 3), (True, 1, 5)],
)
def test_variant_matches_torch(group: int, dot: bool, splits: int, programs: int) -> None:
    q, kv, md = _batch(group, seed=group)
    scale = HEAD_DIM**-0.5
    ref = paged_attention_torch(q, kv, md, scale)
    out, _ = decode_variant(
        q, kv, md, scale, block_n=16, num_warps=2, num_stages=1, dot=dot, splits=splits,
        programs=programs,
    )  # fmt: skip
    assert out.shape == q.shape
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))  # padding tokens: zeros
    assert float(ref[:3].abs().max()) > 0.1  # the reference is not trivially zero
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_item_bounds_balance_tiles() -> None:
    q, kv, md = _batch(2)
    num_items = 6 * NUM_KV_HEADS  # 3 requests, one padded request, two padding tokens
    bounds = item_bounds(md, NUM_KV_HEADS, num_items, programs=3, block_n=16)
    assert bounds.tolist()[0] == 0 and bounds.tolist()[-1] == num_items
    assert all(a <= b for a, b in zip(bounds.tolist(), bounds.tolist()[1:], strict=False))
    # costs (tiles + 1) per item: ctx 1 -> 2, 37 -> 4, 70 -> 6, each twice; 4 padding items 1
    cost = [2, 2, 4, 4, 6, 6, 1, 1, 1, 1, 1, 1]
    starts = [sum(cost[:j]) for j in range(num_items)]
    total = sum(cost)
    for p in range(3):  # brute force: item j goes to the program whose share holds its start
        mine = [j for j in range(num_items) if p * total // 3 <= starts[j] < (p + 1) * total // 3]
        assert list(range(bounds[p], bounds[p + 1])) == mine
