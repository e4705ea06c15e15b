"""The sample EAGLE head / MTP module math against HF transformers' Qwen3 (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from samples.model_shapes import TINY_SHAPES, head_config
from samples.spec_heads import (
    EAGLE_ARCH,
    MTP_ARCH,
    EagleHead,
    MTPModule,
    create_head,
    load_head,
    save_head,
)
from samples.spec_training import chain_head


def _hf_one_layer(seed: int) -> transformers.Qwen3Model:
    """A one-layer HF Qwen3 decoder of the tiny head's shape, with non-trivial norm weights."""
    shape = TINY_SHAPES[0]
    config = transformers.Qwen3Config(
        vocab_size=8, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=1, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def _head_from_hf(architecture: str, hf: transformers.Qwen3Model) -> EagleHead | MTPModule:
    head = create_head(head_config(architecture, TINY_SHAPES[0], 8, "tiny")).eval()
    tensors = {k.replace("layers.0.", "layer."): v for k, v in hf.state_dict().items()
               if not k.startswith(("embed_tokens", "rotary_emb"))}  # fmt: skip
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) == ({"fc.weight"} if architecture == EAGLE_ARCH
                            else {"enorm.weight", "hnorm.weight", "eh_proj.weight"})  # fmt: skip
    with torch.no_grad():
        for name in missing:
            getattr(head, name.split(".")[0]).weight.normal_(0.0, 0.3)
    return head


@pytest.mark.parametrize("architecture", [EAGLE_ARCH, MTP_ARCH])
@pytest.mark.parametrize("offset", [0, 5])
def test_head_is_a_qwen3_layer_on_its_input(architecture: str, offset: int) -> None:
    hf = _hf_one_layer(seed=1)
    head = _head_from_hf(architecture, hf)
    hidden = TINY_SHAPES[0].hidden_size
    embeds, h = torch.randn(2, 9, hidden), torch.randn(2, 9, hidden)
    positions = torch.arange(9) + offset
    with torch.no_grad():
        if isinstance(head, EagleHead):
            x = torch.cat((embeds, h), -1) @ head.fc.weight.T
        else:
            x = torch.cat((head.enorm(embeds), head.hnorm(h)), -1) @ head.eh_proj.weight.T
        expected = hf(inputs_embeds=x, position_ids=positions[None].expand(2, -1)).last_hidden_state
        actual = head(embeds, h, positions)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_chain_feeds_previous_output_and_shifts_positions() -> None:
    hf = _hf_one_layer(seed=2)
    head = _head_from_hf(MTP_ARCH, hf)
    hidden = TINY_SHAPES[0].hidden_size
    embeds, h = torch.randn(1, 7, hidden), torch.randn(1, 7, hidden)
    with torch.no_grad():
        g1, g2 = chain_head(head, embeds, h, 2)
        assert g1.shape == (1, 6, hidden) and g2.shape == (1, 5, hidden)
        torch.testing.assert_close(g1, head(embeds[:, 1:], h[:, :6], torch.arange(6)))
        torch.testing.assert_close(g2, head(embeds[:, 2:], g1[:, :5], torch.arange(5) + 1))


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    head = _head_from_hf(EAGLE_ARCH, _hf_one_layer(seed=3))
    save_head(head, tmp_path)
    loaded = load_head(tmp_path, dtype=torch.float32)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())
