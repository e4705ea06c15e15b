"""Seeded-weight proposers for the spec tests: a draft checkpoint, an EAGLE head, an MTP module.

Heads are built from a config with the engine's own modules, saved as ``config.json`` +
``model.safetensors`` (the format of ``samples/models/README.md``) and loaded back by the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.kernels.backend import TorchKernels
from engine.model.config import ModelConfig
from engine.model.layer_context import LayerContext
from engine.spec.eagle import EAGLE_ARCHITECTURE, EagleHead
from engine.spec.hidden_head import head_model_config
from engine.spec.mtp import MTP_ARCHITECTURE, MTPModule
from tests.engine.conftest import TINY_QWEN3

HEAD_DIMS = {
    "hidden_size": TINY_QWEN3["hidden_size"],
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": TINY_QWEN3["vocab_size"],
    "target": "tiny",
    "torch_dtype": "float32",
}


def target_model_config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=TINY_QWEN3["vocab_size"],
        hidden_size=TINY_QWEN3["hidden_size"],
        intermediate_size=TINY_QWEN3["intermediate_size"],
        num_hidden_layers=TINY_QWEN3["num_hidden_layers"],
        num_attention_heads=TINY_QWEN3["num_attention_heads"],
        num_key_value_heads=TINY_QWEN3["num_key_value_heads"],
        head_dim=TINY_QWEN3["head_dim"],
        max_position_embeddings=TINY_QWEN3["max_position_embeddings"],
        qk_norm=True,
    )


def write_head(folder: Path, architecture: str, seed: int, std: float = 0.1) -> Path:
    """A head of HEAD_DIMS with N(0, std) matrices (norms = 1), saved as the engine reads it."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": architecture, **HEAD_DIMS}
    config = head_model_config(cfg, target_model_config())
    cls = EagleHead if architecture == EAGLE_ARCHITECTURE else MTPModule
    head = cls(config, LayerContext(torch.float32, torch.device("cpu"), TorchKernels()))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v.contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_draft_checkpoint(folder: Path, seed: int) -> Path:
    """A 1-layer Qwen3 draft with the target's vocabulary (HF format)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_QWEN3, hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def spec_models(root: Path, target: str) -> dict[str, str | None]:
    """``--spec-model`` per method for ``target`` (MTP goes to ``<target>/mtp``, its default)."""
    write_head(Path(target) / "mtp", MTP_ARCHITECTURE, seed=3)
    return {
        "ngram": None,
        "draft": str(write_draft_checkpoint(root / "draft", seed=1)),
        "eagle": str(write_head(root / "eagle", EAGLE_ARCHITECTURE, seed=2)),
        "mtp": None,
    }
