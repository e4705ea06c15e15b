"""On the H200: the fused kernels in bf16 round like their torch references (1 ulp), and a
captured CUDA graph of the fused decode forward replays the eager result."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
from engine.kernels.norm import add_rms_norm_torch, add_rms_norm_triton
from engine.kernels.rope import qk_norm_rope_write_kv_torch, qk_norm_rope_write_kv_triton
from engine.model.loader import build_random_model
from engine.model.paged_batch import build_attention_metadata
from tests.engine.test_fused_layers import _config

pytestmark = pytest.mark.gpu
ONE_ULP = {"rtol": 8e-3, "atol": 1e-6}  # bf16 has 8 significant bits


def _randn(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 2).to(torch.bfloat16)


def test_add_rms_norm_and_silu_bf16_within_one_ulp() -> None:
    torch.manual_seed(0)
    x, residual, weight = _randn(64, 1024), _randn(64, 1024), _randn(1024)
    got, expected = (
        add_rms_norm_triton(x, residual, weight, 1e-6),
        add_rms_norm_torch(x, residual, weight, 1e-6),
    )
    assert torch.equal(got[1], expected[1])  # the residual sum rounds to nearest like torch
    torch.testing.assert_close(got[0], expected[0], **ONE_ULP)
    gate_up = _randn(64, 2 * 3072)
    torch.testing.assert_close(silu_and_mul_triton(gate_up), silu_and_mul_torch(gate_up), **ONE_ULP)


def test_qk_norm_rope_bf16_within_one_ulp() -> None:
    torch.manual_seed(1)
    hq, hkv, d, num_tokens = 16, 8, 128, 33
    qkv = _randn(num_tokens, (hq + 2 * hkv) * d)
    cos_sin = _randn(num_tokens, 1, 2 * d).clamp(-1, 1)
    weights = (_randn(d), _randn(d))
    slots = torch.randperm(64, device="cuda")[:num_tokens]
    slots[::5] = -1
    caches = [_randn(2, 4, 16, hkv, d) for _ in range(2)]
    caches[1].copy_(caches[0])
    args = (qkv, cos_sin[..., :d], cos_sin[..., d:], *weights, 1e-6)
    q = qk_norm_rope_write_kv_triton(*args, caches[0], slots, hq)
    q_ref = qk_norm_rope_write_kv_torch(*args, caches[1], slots, hq)
    torch.testing.assert_close(q, q_ref, **ONE_ULP)
    torch.testing.assert_close(caches[0], caches[1], **ONE_ULP)


def test_graph_replay_matches_eager_forward() -> None:
    model = build_random_model(
        _config(num_layers=3), torch.bfloat16, "cuda", seed=0, use_triton=True
    )
    kv = model.allocate_kv_caches(32, 4)
    tables = [[4 * r + j for j in range(4)] for r in range(4)]
    md, positions = build_attention_metadata([6, 2, 9, 11], [1] * 4, tables, 4, "cuda")
    ids = torch.arange(4, device="cuda") + 3
    with torch.no_grad():
        eager = model(ids, positions, md, kv).clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(ids, positions, md, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, positions, md, kv)
        graph.replay()
        torch.cuda.synchronize()
        logits = model.compute_logits(out)
    torch.testing.assert_close(out, eager, **ONE_ULP)
    assert logits.dtype == torch.float32 and logits.shape == (4, 61)
