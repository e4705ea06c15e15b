"""Paged-KV Llama/Qwen2/Qwen3 logits vs HF transformers full-sequence logits (fp32, eager).

Several requests of different lengths are batched together through a prefill, a chunked prefill
(2-3 chunks), a multi-token (verify-shaped) step and >= 8 decode steps, on shuffled blocks.
"""

from __future__ import annotations

# TRITON_INTERPRET is set by tests/conftest.py when there is no CUDA device.
import random  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from engine.kernels.backend import create_kernel_backend  # noqa: E402
from engine.model.llama import LlamaForCausalLM  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.paged_batch import build_attention_metadata  # noqa: E402

BLOCK_SIZE = 4
PROMPT_LENS = [11, 5, 19]
# Each step: tokens advanced per request (0 = request not in this step).
SCHEDULE = [
    [11, 3, 7],  # A full prefill, B and C first chunks
    [1, 2, 8],  # A decodes, B and C second chunks
    [3, 1, 4],  # A verify-shaped (3 tokens), B decodes, C last chunk
    [0, 1, 1],  # A sits out a step
] + [[1, 1, 1]] * 9
TINY: dict[str, Any] = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6,
)  # fmt: skip
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

# name -> (HF config class, extra kwargs)
ARCHES: dict[str, tuple[Any, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {"rope_theta": 10000.0}),
    "llama_rope_llama3": (
        transformers.LlamaConfig,
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
    ),  # fmt: skip
    "qwen2_tied": (transformers.Qwen2Config, {"rope_theta": 1e6, "tie_word_embeddings": True}),
    "qwen3_head_dim_32": (
        transformers.Qwen3Config,
        {"head_dim": 32, "rope_theta": 1e6, "tie_word_embeddings": True},
    ),  # fmt: skip
    "qwen3_rope_yarn": (transformers.Qwen3Config, {"rope_theta": 1e6, "rope_scaling": YARN_ROPE}),
}


def _save_hf_model(name: str, folder: Path) -> transformers.PreTrainedModel:
    config_cls, extra = ARCHES[name]
    hf_config = config_cls(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and biases, so every parameter matters
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            base = 1.0 if pname.endswith("norm.weight") else 0.0
            param.copy_(base + noise * (0.1 if base else 0.08))
    model.save_pretrained(folder)
    return model.eval()


def _run_paged(
    model: LlamaForCausalLM, sequences: list[list[int]], schedule: list[list[int]]
) -> list[torch.Tensor]:
    """Drive the schedule; return per-request logits ``[len, vocab]`` for every position."""
    rng = random.Random(0)
    max_blocks = [-(-len(s) // BLOCK_SIZE) for s in sequences]
    pool = list(range(sum(max_blocks) + 5))
    rng.shuffle(pool)
    block_tables = [[pool.pop() for _ in range(n)] for n in max_blocks]
    kv_caches = model.allocate_kv_caches(len(pool) + sum(max_blocks), BLOCK_SIZE)
    computed = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        active = [i for i, n in enumerate(step) if n > 0]
        metadata, positions = build_attention_metadata(
            [computed[i] for i in active], [step[i] for i in active],
            [block_tables[i] for i in active], BLOCK_SIZE, "cpu", num_padded_tokens=None,
        )  # fmt: skip
        ids = [tok for i in active for tok in sequences[i][computed[i] : computed[i] + step[i]]]
        with torch.no_grad():
            hidden = model(torch.tensor(ids), positions, metadata, kv_caches)
            step_logits = model.compute_logits(hidden)  # [T, vocab]
        offset = 0
        for i in active:
            logits[i].append(step_logits[offset : offset + step[i]])
            offset += step[i]
            computed[i] += step[i]
    return [torch.cat(chunks) for chunks in logits]


@pytest.mark.parametrize("name", list(ARCHES))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    hf_model = _save_hf_model(name, tmp_path)
    model, config = load_model(tmp_path, torch.float32, "cpu")
    assert [config.architecture] == hf_model.config.architectures
    totals = [sum(step[i] for step in SCHEDULE) for i in range(len(PROMPT_LENS))]
    assert all(t - p >= 8 for t, p in zip(totals, PROMPT_LENS, strict=True))
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 97, (t,), generator=gen).tolist() for t in totals]
    ours = _run_paged(model, sequences, SCHEDULE)
    for seq, got in zip(sequences, ours, strict=True):
        with torch.no_grad():
            expected = hf_model(torch.tensor([seq])).logits[0].float()  # [len, vocab]
        rel_err = (got - expected).abs().max() / expected.abs().max()
        assert rel_err <= 1e-4, f"{name}: max relative error {rel_err:.2e}"


def test_triton_model_matches_torch_model(tmp_path: Path) -> None:
    """The same forward with the Triton kernels (interpreter) gives the same logits."""
    _save_hf_model("qwen3_head_dim_32", tmp_path)
    torch_model, _ = load_model(
        tmp_path, torch.float32, "cpu", kernels=create_kernel_backend("torch")
    )
    triton_model, _ = load_model(
        tmp_path, torch.float32, "cpu", kernels=create_kernel_backend("triton")
    )
    gen = torch.Generator().manual_seed(3)
    totals = [sum(step[i] for step in SCHEDULE[:4]) for i in range(len(PROMPT_LENS))]
    sequences = [torch.randint(0, 97, (t,), generator=gen).tolist() for t in totals]
    expected = _run_paged(torch_model, sequences, SCHEDULE[:4])
    got = _run_paged(triton_model, sequences, SCHEDULE[:4])
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_logits_differ_with_wrong_positions(tmp_path: Path) -> None:
    """The comparison can fail: one wrong position changes the logits well beyond 1e-4.

    (Shifting *all* positions would not: RoPE scores depend only on relative positions.)"""
    hf_model = _save_hf_model("llama", tmp_path)
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    seq = list(range(1, 13))
    kv_caches = model.allocate_kv_caches(8, BLOCK_SIZE)
    metadata, positions = build_attention_metadata([0], [12], [[5, 2, 7]], BLOCK_SIZE, "cpu")
    positions[6] = 7
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(seq), positions, metadata, kv_caches))
        expected = hf_model(torch.tensor([seq])).logits[0]
    assert (got - expected).abs().max() / expected.abs().max() > 1e-3
