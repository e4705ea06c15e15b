"""Llama-family building blocks: RMSNorm, SwiGLU MLP, paged-KV attention.

Attribute names follow the HF checkpoints (``q_proj``, ``q_norm``, ``gate_proj``, ...), so a HF
state dict loads without renaming. For speed the projections that read the same input run as
one GEMM: ``q_proj``/``k_proj``/``v_proj`` as ``qkv_weight`` and ``gate_proj``/``up_proj`` as
``gate_up_weight``. Those merged tensors are non-persistent buffers, and each HF-named parameter
is a *view* into them, so loading or filling a parameter in place updates the merged weight too.
(:func:`merge_weights` re-establishes the views if something replaced the parameters' storage,
e.g. ``module.to(...)``.)

Per decoder layer on the Triton path this is: QKV GEMM, one q/k-norm + RoPE + KV-write kernel,
attention, o_proj GEMM, a fused residual-add + RMSNorm, gate_up GEMM, SiLU-and-mul, down GEMM
(plus the first fused add + RMSNorm, which :class:`~engine.model.llama.DecoderLayer` owns).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_linear import column_linear, row_linear
from engine.kernels.attention_metadata import AttentionMetadata
from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext

__all__ = ["Attention", "MLP", "RMSNorm", "merge_weights"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in fp32 like HF."""

    def __init__(self, size: int, eps: float, ctx: LayerContext) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = ctx.kernels
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device))

    # stepscope: hot
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of ``x: [..., size]``."""
        return self.kernels.rms_norm(x, self.weight, self.eps)

    # stepscope: hot
    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` for ``x, residual: [T, size]``, one kernel."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


def _merge_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``linears`` along the output dim; re-point their parameters to views of it.

    Returns ``(weight [sum(out), in], bias [sum(out)] or None)``.
    """
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        bias = (
            torch.cat([lin.bias for lin in linears if lin.bias is not None]) if has_bias else None
        )
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = nn.Parameter(weight[start:end], requires_grad=lin.weight.requires_grad)
        if bias is not None and lin.bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=lin.bias.requires_grad)
        start = end
    return weight, bias


def _views_of(linears: list[nn.Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether every linear's weight (and bias) still aliases its slice of the merged tensors."""
    start = 0
    for lin in linears:
        if lin.weight.data_ptr() != weight[start].data_ptr():
            return False
        if (
            bias is not None
            and lin.bias is not None
            and lin.bias.data_ptr() != bias[start:].data_ptr()
        ):
            return False
        start += lin.out_features
    return True


class MLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with gate/up as one GEMM."""

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.kernels = ctx.kernels
        tp, dtype, device = ctx.tp, ctx.dtype, ctx.device
        # Tensor parallel (tp): gate/up split by output rows, down by input columns + all-reduce.
        self.gate_proj = column_linear(hidden, inter, False, tp, dtype, device)
        self.up_proj = column_linear(hidden, inter, False, tp, dtype, device)
        self.down_proj = row_linear(inter, hidden, False, tp, dtype, device)
        self.local = tp is None  # down_proj is a plain GEMM (kernels.linear), no all-reduce
        self.gate_up_weight: torch.Tensor  # [2 * inter, hidden]
        self.merge_weights()

    def merge_weights(self) -> None:
        """(Re)build ``gate_up_weight`` with ``gate_proj``/``up_proj`` weights as views of it."""
        pair = [self.gate_proj, self.up_proj]
        merged = getattr(self, "gate_up_weight", None)
        if merged is not None and _views_of(pair, merged, None):
            return
        weight, _ = _merge_linears(pair)
        self.register_buffer("gate_up_weight", weight, persistent=False)

    # stepscope: hot
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [T, hidden] -> [T, hidden]``."""
        gate_up = self.kernels.linear(x, self.gate_up_weight)  # [T, 2 * inter]
        act = self.kernels.silu_and_mul(gate_up)
        if self.local:
            return self.kernels.linear(act, self.down_proj.weight)
        return self.down_proj(act)


class Attention(nn.Module):
    """GQA self-attention over a paged KV cache.

    Each call writes this step's K/V into the cache through ``slot_mapping`` and then attends,
    for every query token, to its request's cached KV up to its own position.
    """

    def __init__(self, config: ModelConfig, ctx: LayerContext) -> None:
        super().__init__()
        tp, dtype, device = ctx.tp, ctx.dtype, ctx.device
        # Tensor parallel (tp): this rank's heads only (q, k, v split by heads; o_proj by input
        # columns + all-reduce). Every rank needs whole KV heads: kv heads % tp == 0.
        world = 1 if tp is None else tp.world_size
        if config.num_attention_heads % world or config.num_key_value_heads % world:
            raise ValueError(
                f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads do "
                f"not split over tensor_parallel_size={world}"
            )
        self.num_heads = config.num_attention_heads // world
        self.num_kv_heads = config.num_key_value_heads // world
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.kernels = ctx.kernels
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = column_linear(hidden, config.q_size, bias, tp, dtype, device)
        self.k_proj = column_linear(hidden, config.kv_size, bias, tp, dtype, device)
        self.v_proj = column_linear(hidden, config.kv_size, bias, tp, dtype, device)
        self.o_proj = row_linear(config.q_size, hidden, False, tp, dtype, device)
        self.local = tp is None  # o_proj is a plain GEMM (kernels.linear), no all-reduce
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ctx)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ctx)
        self.eps = config.rms_norm_eps
        self.qkv_weight: torch.Tensor  # [q_size + 2 * kv_size, hidden]
        self.qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2) or None
        self.merge_weights()

    def merge_weights(self) -> None:
        """(Re)build ``qkv_weight``/``qkv_bias`` with the q/k/v parameters as views of them."""
        triple = [self.q_proj, self.k_proj, self.v_proj]
        merged = getattr(self, "qkv_weight", None)
        if merged is not None and _views_of(triple, merged, self.qkv_bias):
            return
        weight, bias = _merge_linears(triple)
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    # stepscope: hot
    def forward(
        self,
        hidden_states: torch.Tensor,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden_states: [T, hidden]`` -> ``[T, hidden]``; ``rope_cos_sin``: ``[T, 1, D]`` each."""
        num_tokens = hidden_states.shape[0]
        qkv = self.kernels.linear(
            hidden_states, self.qkv_weight, self.qkv_bias
        )  # [T, (Hq + 2 Hkv) * D]
        q_norm_weight = None if self.q_norm is None else self.q_norm.weight
        k_norm_weight = None if self.k_norm is None else self.k_norm.weight
        cos, sin = rope_cos_sin
        # q: [T, Hq, D]; K/V of this step are now in kv_cache
        q = self.kernels.qk_norm_rope_write_kv(
            qkv, cos, sin, q_norm_weight, k_norm_weight, self.eps,
            kv_cache, attn_metadata.slot_mapping, self.num_heads,
        )  # fmt: skip
        out = self.kernels.paged_attention(q, kv_cache, attn_metadata, self.scale)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.local:
            return self.kernels.linear(out, self.o_proj.weight)
        return self.o_proj(out)


def merge_weights(model: nn.Module) -> None:
    """Make every merged QKV / gate-up weight in ``model`` alias its HF-named parameters again.

    A no-op (a pointer check per module) while the views are intact."""
    for module in model.modules():
        if isinstance(module, (Attention, MLP)):
            module.merge_weights()
