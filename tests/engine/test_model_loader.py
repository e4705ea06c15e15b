"""ModelConfig parsing, RoPE frequencies, checkpoint loading errors, random models, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    build_random_model,
    load_model,
    load_tokenizer,
    qwen3_0_6b_config,
    qwen3_8b_config,
)
from engine.model.paged_batch import build_attention_metadata
from engine.model.rope import rope_inv_freq

TINY: dict[str, Any] = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def _save_tiny_llama(
    folder: Path, max_shard_size: str | None = None
) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**TINY)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 5e5,
    },  # fmt: skip
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 1e6,
    },  # fmt: skip
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_inv_freq_matches_transformers(name: str) -> None:
    hf_config = transformers.LlamaConfig(**TINY, rope_parameters=dict(ROPES[name]))
    rope_type = ROPES[name]["rope_type"]
    init_fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init_fn is None:  # transformers 5 keeps "default" on the model's rotary class
        init_fn = LlamaRotaryEmbedding.compute_default_rope_parameters
    expected, expected_factor = init_fn(hf_config, device="cpu")
    inv_freq, factor = rope_inv_freq(ModelConfig.from_hf_config(hf_config))
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_dynamic_rope_is_refused() -> None:
    hf_config = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "dynamic",
                                                                  "factor": 2.0})  # fmt: skip
    with pytest.raises(ValueError, match="dynamic"):
        ModelConfig.from_hf_config(hf_config)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_config(transformers.GPT2Config())
    _save_tiny_llama(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["architectures"] = ["LlamaForSequenceClassification"]
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForSequenceClassif"):
        load_model(tmp_path, torch.float32, "cpu")


def test_invalid_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig.from_hf_config(transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 3}))


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_checkpoint_tensor_mismatch_names_the_tensor(tmp_path: Path, change: str) -> None:
    _save_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.up_proj.weight"
    if change == "missing":
        del tensors[name]
    else:
        name = "model.layers.1.mlp.extra_proj.weight"
        tensors[name] = torch.zeros(2)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=f"{change}.*{name.replace('.', '[.]')}"):
        load_model(tmp_path, torch.float32, "cpu")


def test_sharded_checkpoint_loads_every_tensor(tmp_path: Path) -> None:
    hf_model = _save_tiny_llama(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path, torch.bfloat16, "cpu")
    ours = dict(model.named_parameters())
    for name, param in hf_model.named_parameters():
        assert torch.equal(ours[name], param.to(torch.bfloat16)), name


def test_random_model_is_seeded_and_not_degenerate() -> None:
    config = ModelConfig.from_hf_config(transformers.Qwen3Config(**TINY, head_dim=16))
    a = build_random_model(config, torch.float32, "cpu", seed=7)
    b = build_random_model(config, torch.float32, "cpu", seed=7)
    c = build_random_model(config, torch.float32, "cpu", seed=8)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])
    metadata, positions = build_attention_metadata([0], [8], [[1, 0]], 4, "cpu")
    with torch.no_grad():
        hidden = a(torch.arange(8), positions, metadata, a.allocate_kv_caches(2, 4))
        probs = a.compute_logits(hidden).softmax(-1)  # [8, vocab]
    assert a.compute_logits(hidden).dtype == torch.float32
    assert 0.1 / 64 < probs.max() < 0.9  # neither flat nor one-hot


def test_qwen3_0_6b_shape() -> None:
    config = qwen3_0_6b_config()
    model = LlamaForCausalLM(config, torch.bfloat16, "meta")
    num_params = sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert num_params == 596_049_920  # Qwen3-0.6B with tied embeddings


def test_qwen3_8b_shape() -> None:
    """The named preset has Qwen3-8B's parameter counts (model card: 8.2B, 6.95B non-embedding)."""
    model = LlamaForCausalLM(qwen3_8b_config(), torch.bfloat16, "meta")
    num_params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert num_params == 8_190_735_360
    assert num_params - 2 * embedding == 6_946_075_648


def test_load_tokenizer_from_local_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        tmp_path
    )
    assert load_tokenizer(tmp_path).encode("hello world") == [1, 2]
