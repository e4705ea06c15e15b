"""KV write: torch reference vs a plain per-token loop; Triton (interpreter) vs torch."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.kv_write import write_kv_torch, write_kv_triton  # noqa: E402

NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def _inputs(
    slots: list[int], block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(slots) * 31 + block_size)
    shape = (2, NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.randn(shape, generator=gen).to(dtype)
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return k, v, cache, torch.tensor(slots, dtype=torch.int64)


def _expected(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    out = cache.clone()
    block_size = cache.shape[2]
    for t, slot in enumerate(slots):
        if slot >= 0:
            out[0, slot // block_size, slot % block_size] = k[t]
            out[1, slot // block_size, slot % block_size] = v[t]
    return out


SLOTS = {
    "contiguous": [0, 1, 2, 3, 4],
    "scattered_with_padding": [-1, 17, 3, -1, 22, 9, -1],
    "padding_first": [-1, -1, 5],
    "all_padding": [-1, -1, -1],
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("name", list(SLOTS))
@pytest.mark.parametrize("impl", [write_kv_torch, write_kv_triton], ids=["torch", "triton"])
def test_write_kv_matches_loop(name: str, block_size: int, impl: object) -> None:
    slots = SLOTS[name]
    k, v, cache, slot_mapping = _inputs(slots, block_size, torch.float32)
    expected = _expected(k, v, cache, slots)
    impl(k, v, cache, slot_mapping)  # type: ignore[operator]
    assert torch.equal(cache, expected)


def test_write_kv_torch_bf16_exact() -> None:
    """bf16 values are stored bit-exactly (no arithmetic on the written values)."""
    slots = [-1, 7, 2, -1]
    k, v, cache, slot_mapping = _inputs(slots, 4, torch.bfloat16)
    expected = _expected(k, v, cache, slots)
    write_kv_torch(k, v, cache, slot_mapping)
    assert torch.equal(cache, expected)
