"""Shard rules without processes: every rank's slice of every weight, against the full model."""

from __future__ import annotations

import pytest
import torch

from engine.distributed.parallel_linear import ShardSpec, shard_specs
from engine.distributed.parallel_state import TPGroup
from engine.model.config import ModelConfig
from engine.model.loader import build_random_model
from instrument.schema import parse_rank_trace_path, rank_trace_path

CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM", vocab_size=101, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=True, qk_norm=False, attention_bias=True, eos_token_ids=(1,),
    bos_token_id=None,
)  # fmt: skip


@pytest.mark.parametrize("rank", [0, 1])
def test_random_shards_are_slices_of_the_full_model(rank: int) -> None:
    """Qwen2 (q/k/v bias), tied embeddings, vocab 101 (padded to 51 + 51 rows)."""
    full = dict(build_random_model(CONFIG, torch.float32, "cpu", seed=5).named_parameters())
    group = TPGroup(rank, 2, device_group=None, cpu_group=None, on_cuda=False)
    model = build_random_model(CONFIG, torch.float32, "cpu", seed=5, tp=group)
    specs = shard_specs(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert attn.qkv_weight.shape == (2 * 8 + 2 * 8, 32)  # [q_r; k_r; v_r]
    for name, param in model.named_parameters():
        expected = specs[name].shard(full[name]) if name in specs else full[name]
        torch.testing.assert_close(param, expected, rtol=0, atol=0, msg=name)
    embed = specs["model.embed_tokens.weight"]
    assert (embed.size, embed.num_valid) == (51, 51 if rank == 0 else 50)
    assert "model.layers.0.self_attn.o_proj.weight" in specs
    assert specs["model.layers.0.self_attn.o_proj.weight"].dim == 1
    assert "model.layers.0.input_layernorm.weight" not in specs


def test_shard_spec_padding_and_errors() -> None:
    full = torch.arange(10.0).reshape(5, 2)
    last = ShardSpec(0, 5, rank=2, world_size=3, padded=True)  # rows 4..5, one past the end
    torch.testing.assert_close(last.shard(full), torch.tensor([[8.0, 9.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="does not split"):
        ShardSpec(1, 5, rank=0, world_size=2)


def test_rank_trace_paths() -> None:
    assert rank_trace_path("out/run.pftrace", 1) == "out/run.rank1.pftrace"
    assert rank_trace_path("out/run.rank0.pftrace", 3) == "out/run.rank3.pftrace"
    assert parse_rank_trace_path("a.b/run.rank12.pftrace") == ("a.b/run", 12, ".pftrace")
    assert parse_rank_trace_path("run.pftrace") is None
