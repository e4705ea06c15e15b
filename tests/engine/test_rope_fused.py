"""Fused q/k RMSNorm + RoPE + KV write: torch reference vs a float64 per-head loop; Triton vs torch."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.kernels.rope import (  # noqa: E402
    qk_norm_rope_write_kv_torch,
    qk_norm_rope_write_kv_triton,
)

EPS = 1e-6
NUM_BLOCKS, BLOCK_SIZE = 5, 4
BF16_INTERP_TOL = {"rtol": 3e-2, "atol": 2e-2}  # the interpreter truncates fp32 -> bf16
# name -> (Hq, Hkv, D, slots); slot -1 = padding token
CASES = {
    "gqa_with_padding": (4, 2, 16, [3, -1, 17, 8, -1]),
    "mha_odd_half": (2, 2, 10, [0, 1, 2]),
    "all_padding": (4, 1, 8, [-1, -1]),
}


def _inputs(hq: int, hkv: int, d: int, num_tokens: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(hq * 100 + d)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen) * 2
    positions = torch.randint(0, 50, (num_tokens,), generator=gen)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None].float() * inv_freq  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)[:, None, :]  # [T, 1, 2D]
    return {
        "qkv": qkv.to(dtype),
        "cos": cos_sin[..., :d],  # [T, 1, D] strided views, as RotaryEmbedding returns them
        "sin": cos_sin[..., d:],
        "q_norm_weight": (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype),
        "k_norm_weight": (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype),
        "kv_cache": torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, hkv, d, generator=gen).to(dtype),
    }


def _expected_f64(args: dict, hq: int, slots: list[int], norm: bool) -> tuple[torch.Tensor, ...]:
    """Per token and head in float64: norm, rotate, write; returns (q, cache)."""
    qkv, cache = args["qkv"].double(), args["kv_cache"].double().clone()
    hkv, d = cache.shape[3], cache.shape[4]
    cos, sin = args["cos"][:, 0].double(), args["sin"][:, 0].double()
    q = torch.zeros(qkv.shape[0], hq, d, dtype=torch.float64)
    for t in range(qkv.shape[0]):
        for h in range(hq + hkv):
            x = qkv[t, h * d : (h + 1) * d]
            if norm:
                w = args["q_norm_weight" if h < hq else "k_norm_weight"].double()
                x = w * x / math.sqrt(float((x * x).mean()) + EPS)
            rotated = torch.cat((-x[d // 2 :], x[: d // 2]))
            x = x * cos[t] + rotated * sin[t]
            if h < hq:
                q[t, h] = x
            elif slots[t] >= 0:
                cache[0].view(-1, hkv, d)[slots[t], h - hq] = x
        if slots[t] >= 0:
            cache[1].view(-1, hkv, d)[slots[t]] = qkv[t, (hq + hkv) * d :].view(hkv, d)
    return q, cache


def _run(impl: object, args: dict, hq: int, slots: list[int], norm: bool) -> tuple:
    cache = args["kv_cache"].clone()
    q = impl(  # type: ignore[operator]
        args["qkv"], args["cos"], args["sin"],
        args["q_norm_weight"] if norm else None, args["k_norm_weight"] if norm else None,
        EPS, cache, torch.tensor(slots, dtype=torch.int64), hq,
    )  # fmt: skip
    return q, cache


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "impl", [qk_norm_rope_write_kv_torch, qk_norm_rope_write_kv_triton], ids=["torch", "triton"]
)
def test_fp32_matches_float64_loop(impl: object, case: str, norm: bool) -> None:
    hq, hkv, d, slots = CASES[case]
    args = _inputs(hq, hkv, d, len(slots), torch.float32)
    q, cache = _run(impl, args, hq, slots, norm)
    q_ref, cache_ref = _expected_f64(args, hq, slots, norm)
    torch.testing.assert_close(q, q_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, cache_ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_triton_matches_torch(case: str) -> None:
    hq, hkv, d, slots = CASES[case]
    args = _inputs(hq, hkv, d, len(slots), torch.bfloat16)
    q, cache = _run(qk_norm_rope_write_kv_triton, args, hq, slots, True)
    q_ref, cache_ref = _run(qk_norm_rope_write_kv_torch, args, hq, slots, True)
    torch.testing.assert_close(q, q_ref, **BF16_INTERP_TOL)
    torch.testing.assert_close(cache, cache_ref, **BF16_INTERP_TOL)
    untouched = [s for s in range(NUM_BLOCKS * BLOCK_SIZE) if s not in slots]
    before = args["kv_cache"].flatten(1, 2)[:, untouched]  # [2, n, Hkv, D]
    assert torch.equal(cache.flatten(1, 2)[:, untouched], before)


def test_wrong_rotation_is_caught() -> None:
    """The float64 loop tells a rotation by the wrong positions apart."""
    hq, hkv, d, slots = CASES["gqa_with_padding"]
    args = _inputs(hq, hkv, d, len(slots), torch.float32)
    q_ref, _ = _expected_f64(args, hq, slots, True)
    args["cos"], args["sin"] = args["cos"].flip(0), args["sin"].flip(0)
    q, _ = _run(qk_norm_rope_write_kv_triton, args, hq, slots, True)
    assert not torch.allclose(q, q_ref.float(), atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backend_and_shape_checks(backend: str) -> None:
    hq, hkv, d, slots = CASES["gqa_with_padding"]
    args = _inputs(hq, hkv, d, len(slots), torch.float32)
    cache = args["kv_cache"].clone()
    q = create_kernel_backend(backend).qk_norm_rope_write_kv(
        args["qkv"], args["cos"], args["sin"], None, None, EPS, cache, torch.tensor(slots), hq,
    )  # fmt: skip
    assert q.shape == (len(slots), hq, d)
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope_write_kv_triton(
            args["qkv"][:, :-1], args["cos"], args["sin"], None, None, EPS, cache,
            torch.tensor(slots), hq,
        )  # fmt: skip
