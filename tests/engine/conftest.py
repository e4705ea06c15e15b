"""Tiny real models for engine tests: HF checkpoints written from a config with seeded weights."""

from __future__ import annotations

import json

import pytest
import torch

TINY_QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "rope_theta": 10000.0,
}


@pytest.fixture(scope="session")
def tiny_model_config(tmp_path_factory) -> str:
    """A JSON config file for ``--model-config`` with random weights."""
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(TINY_QWEN3))
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory) -> str:
    """A HF Qwen3 checkpoint folder (safetensors) with seeded random weights, sharp logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("ckpt")
    cfg = dict(TINY_QWEN3)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights: varied, non-degenerate greedy continuations
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The spec tests' target: a private copy of the tiny checkpoint (its ``mtp/`` folder is
    written into it). A module may define its own ``checkpoint``."""
    import shutil

    folder = tmp_path_factory.mktemp("target") / "tiny"
    shutil.copytree(tiny_hf_checkpoint, folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Seeded proposers for ``checkpoint`` (tests/engine/spec_fixtures.py): draft model, EAGLE
    head, MTP module, None for n-gram."""
    from tests.engine.spec_fixtures import spec_models

    return spec_models(tmp_path_factory.mktemp("spec"), checkpoint)
