"""The fused decoder: merged weights alias the HF-named parameters, the layer API still composes,
and a Triton decode step launches at most 9 kernels per layer."""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
from collections import Counter  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.layers import merge_weights  # noqa: E402
from engine.model.llama import DecoderLayer, LlamaForCausalLM  # noqa: E402
from engine.model.loader import build_random_model, load_state_dict  # noqa: E402
from engine.model.paged_batch import build_attention_metadata  # noqa: E402

KERNELS_PER_LAYER = 9  # add+norm, QKV GEMM, norm+RoPE+KV write, decode attention (it zeroes
# padding rows itself: no fill), o_proj GEMM, add+norm, gate_up GEMM, SiLU*mul, down GEMM


def _config(num_layers: int = 2, qwen2_bias: bool = False) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen2ForCausalLM" if qwen2_bias else "Qwen3ForCausalLM",
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
        qk_norm=not qwen2_bias, attention_bias=qwen2_bias,
    )  # fmt: skip


def _decode_batch(model: LlamaForCausalLM, batch: int) -> tuple[Any, ...]:
    kv = model.allocate_kv_caches(4 * batch + 1, 4)
    tables = [[4 * r + j for j in range(4)] for r in range(batch)]
    md, positions = build_attention_metadata(
        [5 + r for r in range(batch)], [1] * batch, tables, 4, "cpu"
    )
    ids = torch.arange(batch) + 7
    # fill the cache with this batch's prefixes (prefill), so attention reads real K/V
    ctx_md, ctx_pos = build_attention_metadata(
        [0] * batch, [5 + r for r in range(batch)], tables, 4, "cpu"
    )
    with torch.no_grad():
        model(torch.arange(ctx_pos.shape[0]) % 61, ctx_pos, ctx_md, kv)
    return ids, positions, md, kv


def test_merged_weights_alias_hf_parameters() -> None:
    model = build_random_model(_config(qwen2_bias=True), torch.float32, "cpu", seed=0)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert not any("qkv" in k or "gate_up" in k for k in model.state_dict())
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.5)
        attn.v_proj.bias.fill_(-2.0)
        mlp.up_proj.weight.fill_(3.0)
    q_size, kv_size = 4 * 8, 2 * 8
    assert torch.all(attn.qkv_weight[q_size : q_size + kv_size] == 0.5)
    assert torch.all(attn.qkv_bias[q_size + kv_size :] == -2.0)
    assert torch.all(mlp.gate_up_weight[48:] == 3.0) and not torch.all(
        mlp.gate_up_weight[:48] == 3.0
    )


def test_storage_replaced_then_load_restores_views() -> None:
    """``.to()`` gives parameters new storage; loading re-merges before copying."""
    model = build_random_model(_config(), torch.float32, "cpu", seed=0)
    tensors = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}
    model.to(torch.float64)
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.data_ptr() != attn.qkv_weight.data_ptr()
    load_state_dict(model, tensors)
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    torch.testing.assert_close(
        attn.qkv_weight[:32], tensors["model.layers.1.self_attn.q_proj.weight"].double()
    )
    merge_weights(model)  # a no-op while intact
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()


@pytest.mark.parametrize("use_triton", [False, True])
def test_layer_forward_matches_separate_projections(use_triton: bool) -> None:
    """DecoderLayer.forward (the API spec heads use) == the unfused math on HF-named weights."""
    cfg = _config(num_layers=1, qwen2_bias=True)
    model = build_random_model(
        cfg,
        torch.float32,
        "cpu",
        seed=1,
        kernels=create_kernel_backend("triton" if use_triton else "torch"),
    )
    layer = model.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    ids, positions, md, kv = _decode_batch(model, 3)
    h = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    cos_sin = model.model.rotary_emb(positions, h.dtype)
    kv_ref = [c.clone() for c in kv]
    with torch.no_grad():
        got = layer(h, cos_sin, kv[0], md)
        expected = _unfused_layer(layer, h, cos_sin, kv_ref[0], md)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[0], kv_ref[0], rtol=1e-5, atol=1e-5)


def _unfused_layer(
    layer: DecoderLayer, h: torch.Tensor, cos_sin: Any, kv: torch.Tensor, md: Any
) -> torch.Tensor:
    from engine.kernels.attention import paged_attention_torch
    from engine.kernels.kv_write import write_kv_torch
    from engine.model.rope import apply_rotary

    a, m = layer.self_attn, layer.mlp
    x = layer.input_layernorm.weight * F.rms_norm(h, (32,), eps=1e-6)
    q = a.q_proj(x).view(-1, 4, 8)
    k, v = a.k_proj(x).view(-1, 2, 8), a.v_proj(x).view(-1, 2, 8)
    q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
    write_kv_torch(k, v, kv, md.slot_mapping)
    h = h + a.o_proj(paged_attention_torch(q, kv, md, a.scale).reshape(-1, 32))
    x = layer.post_attention_layernorm.weight * F.rms_norm(h, (32,), eps=1e-6)
    return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


def _count_kernels(fn: Callable[[], object]) -> Counter[str]:
    """aten ops that launch a kernel (views and allocations excluded) + Triton launches."""
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    no_kernel = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "expand", "t", "detach",
                 "empty", "empty_like", "new_empty", "split_with_sizes", "alias", "reshape"}  # fmt: skip
    counts: Counter[str] = Counter()

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._schema.name.split("::")[1] not in no_kernel:
                counts[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    run = interp.InterpretedFunction.run

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["triton:" + self.fn.__name__] += 1
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    interp.InterpretedFunction.run = counted  # type: ignore[method-assign]
    try:
        with _Ops():
            fn()
    finally:
        interp.InterpretedFunction.run = run  # type: ignore[method-assign]
    return counts


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreter launches (CPU only)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_step_kernel_budget(dtype: torch.dtype) -> None:
    """embedding + RoPE gather (+ cast) + 10 per layer + final add+norm; the torch path is >4x."""
    counts = {}
    for num_layers in (1, 3):
        model = build_random_model(
            _config(num_layers), dtype, "cpu", seed=0, kernels=create_kernel_backend("triton")
        )
        ids, positions, md, kv = _decode_batch(model, 2)
        with torch.no_grad():
            counts[num_layers] = _count_kernels(lambda: model(ids, positions, md, kv))  # noqa: B023
    per_layer = (sum(counts[3].values()) - sum(counts[1].values())) / 2
    assert per_layer == KERNELS_PER_LAYER, counts[3]
    assert sum(counts[1].values()) <= KERNELS_PER_LAYER + 4, counts[1]
    assert counts[3]["aten::mm"] == 4 * 3  # QKV, o_proj, gate_up, down


def test_bf16_triton_model_close_to_torch_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernels in bf16 at model level. Attention takes the torch path in both models:
    the Triton 3.9 interpreter's bf16 ``tl.dot`` returns garbage (a 16x16 product is off by
    ~1e10), which is an interpreter limit, not a kernel bug; the GPU tests cover it."""
    from engine.kernels.backend import TorchKernels, TritonKernels

    monkeypatch.setattr(TritonKernels, "paged_attention", TorchKernels.paged_attention)
    cfg = _config(num_layers=2)
    torch_model = build_random_model(
        cfg, torch.bfloat16, "cpu", seed=2, kernels=create_kernel_backend("torch")
    )
    triton_model = build_random_model(
        cfg, torch.bfloat16, "cpu", seed=2, kernels=create_kernel_backend("triton")
    )
    logits = []
    for model in (torch_model, triton_model):
        ids, positions, md, kv = _decode_batch(model, 3)
        with torch.no_grad():
            logits.append(model.compute_logits(model(ids, positions, md, kv)))
    rel = (logits[1] - logits[0]).abs().max() / logits[0].abs().max()
    assert rel <= 3e-2, f"bf16 Triton vs torch relative error {rel:.2e}"
