"""Proposer pieces: n-gram lookup against a plain loop, the lookahead block table, head loading
(round trip and strict errors), draft sampling, and the registry."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import CacheConfig, ConfigError, SchedulerConfig, SpecConfig
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import TorchKernels
from engine.model.layer_context import LayerContext
from engine.spec.draft_kv import LookaheadKV
from engine.spec.eagle import EAGLE_ARCHITECTURE, EagleHead
from engine.spec.hidden_head import head_model_config, load_head_weights
from engine.spec.mtp import MTP_ARCHITECTURE
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import ProposeInputs, ProposerContext, create_proposer, sample_drafts
from tests.engine.spec_fixtures import HEAD_DIMS, target_model_config, write_head


def _inputs(context: list[list[int]], bonus_pos: list[int], **extra) -> ProposeInputs:
    b, width = len(context), 64
    table = torch.zeros(b + 1, width, dtype=torch.int64)
    for r, tokens in enumerate(context):
        table[r, : len(tokens)] = torch.tensor(tokens)
    fields = dict(
        num_reqs=b,
        num_tokens=b,
        max_seq_len=max(bonus_pos) + 1,
        max_model_len=width,
        input_ids=torch.zeros(b, dtype=torch.int64),
        positions=torch.zeros(b, dtype=torch.int64),
        hidden_states=torch.zeros(b, 4),
        attn_metadata=None,
        rows=torch.arange(b),
        token_rows=torch.arange(b),
        anchor_token_idx=torch.arange(b),
        bonus_ids=torch.zeros(b, dtype=torch.int64),
        bonus_pos=torch.tensor(bonus_pos),
        block_table=torch.zeros(b, 4, dtype=torch.int32),
        num_blocks=torch.zeros(b, dtype=torch.int32),
        token_ids=table,
        temperature=torch.zeros(b),
        seeds=torch.zeros(b, dtype=torch.int64),
        all_greedy=True,
    )
    fields.update(extra)
    return ProposeInputs(**fields)


def _ngram_reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    p = len(tokens) - 1
    for n in range(max_n, min_n - 1, -1):
        if p - n + 1 < 0:
            continue
        suffix = tokens[p - n + 1 :]
        for i in range(p - n, -1, -1):  # latest earlier occurrence ending before p
            if tokens[i : i + n] == suffix:
                return [tokens[min(i + n + j, p)] for j in range(k)]
    return [tokens[p]] * k


def test_ngram_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 4, (int(n),), generator=g).tolist() for n in [1, 2, 5, 9, 17, 30]]
    contexts.append([7, 8, 9, 7, 8, 9, 7, 8])  # a clean repeat
    proposer = NgramProposer(num_spec_tokens=4, max_ngram=3, min_ngram=1)
    # stale drafts past P must never be read: put junk there
    padded = [c + [99, 98, 97] for c in contexts]
    out = proposer.propose(_inputs(padded, [len(c) - 1 for c in contexts]))
    expected = [_ngram_reference(c, 4, 3, 1) for c in contexts]
    assert out.draft_ids.tolist() == expected
    assert out.draft_probs is None
    assert expected[-1] == [9, 7, 8, 8]


def test_lookahead_blocks_stay_private():
    kv = LookaheadKV(num_blocks=10, block_size=4, max_num_reqs=3, num_spec_tokens=5)
    assert kv.lookahead_blocks == 3 and kv.num_blocks == 10 + 4 * 3
    inputs = _inputs(
        [[1], [1]],
        [6, 2],
        rows=torch.tensor([2, 0]),
        block_table=torch.tensor([[4, 7, 0, 0], [9, 0, 0, 0]], dtype=torch.int32),
        num_blocks=torch.tensor([2, 1], dtype=torch.int32),
        max_model_len=16,
    )
    table = kv.chain_block_table(inputs)
    assert table.tolist() == [[4, 7, 16, 17, 18, 18, 18], [9, 10, 11, 12, 12, 12, 12]]
    positions = kv.chain_positions(inputs, 3)  # [9, 5]
    md = kv.chain_metadata(inputs, table, positions)
    assert isinstance(md, AttentionMetadata)
    assert md.slot_mapping.tolist() == [16 * 4 + 1, 10 * 4 + 1]
    assert md.seq_lens.tolist() == [10, 6]


def test_head_round_trip_and_strict_loading(tmp_path):
    folder = write_head(tmp_path / "eagle", EAGLE_ARCHITECTURE, seed=4)
    config = head_model_config(
        {"architecture": EAGLE_ARCHITECTURE, **HEAD_DIMS}, target_model_config()
    )
    head = EagleHead(config, LayerContext(torch.float32, torch.device("cpu"), TorchKernels()))
    load_head_weights(head, folder, EAGLE_ARCHITECTURE)
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))
    assert set(saved) == {n for n, _ in head.named_parameters()}
    assert "fc.weight" in saved and saved["fc.weight"].shape == (64, 128)
    for name, p in head.named_parameters():
        assert torch.equal(p, saved[name])
    with pytest.raises(ConfigError, match="architecture"):
        load_head_weights(head, folder, MTP_ARCHITECTURE)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["head_dim"]
    with pytest.raises(ConfigError, match="head_dim"):
        head_model_config(cfg, target_model_config())


def test_sample_drafts_greedy_and_seeded():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    ids, probs = sample_drafts(logits, torch.zeros(2), torch.zeros(2, dtype=torch.int64),
                               torch.zeros(2, dtype=torch.int64), True, TorchKernels())  # fmt: skip
    assert ids.tolist() == [1, 0] and probs is None
    temperature = torch.tensor([0.0, 1.0])
    seeds, positions = torch.tensor([5, 6]), torch.tensor([10, 11])
    ids, probs = sample_drafts(logits, temperature, seeds, positions, False, TorchKernels())
    again, _ = sample_drafts(logits, temperature, seeds, positions, False, TorchKernels())
    assert torch.equal(ids, again) and ids[0] == 1
    assert probs is not None and probs[0].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(probs[1], torch.softmax(logits[1], 0))


def test_registry_rejects_unknown_and_missing_models():
    ctx = ProposerContext(
        target=None,
        spec=SpecConfig(spec_method="ngram", num_spec_tokens=2),  # no spec_model
        cache=CacheConfig(block_size=4, num_kv_blocks=4),
        limits=SchedulerConfig(max_num_seqs=2),
        layers=LayerContext(torch.float32, torch.device("cpu"), TorchKernels()),
    )
    with pytest.raises(ValueError, match="unknown spec method"):
        create_proposer("medusa", ctx)
    for method in ("draft", "eagle", "mtp"):
        with pytest.raises(ConfigError, match="needs spec_model"):
            create_proposer(method, ctx)
    assert create_proposer("ngram", ctx).num_spec_tokens == 2
