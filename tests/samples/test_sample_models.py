"""The committed sample models, tokenizer and workloads (CPU, fp32 where computed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from samples.spec_heads import EAGLE_ARCH, MTP_ARCH, load_head
from samples.spec_training import chain_head

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
MODELS = SAMPLES / "models"
TARGET, DRAFT = MODELS / "pycoder-14m", MODELS / "pycoder-draft-2m"
EAGLE, MTP = MODELS / "pycoder-14m-eagle", MODELS / "pycoder-14m" / "mtp"
WORKLOADS = SAMPLES / "workloads"

SNIPPETS = [
    "def f(x):\n    return x + 1\n",
    'class A(B):\n    """Doc with ünïcödé and 日本語."""\n\n    def __init__(self):\n\t\tpass\r\n',
    "    if not (a <= b and c != d):  # trailing spaces   \n        raise ValueError(f'{a!r}')\n",
    "x = [i ** 2 for i in range(10) if i % 3]\n\n\n@decorator\nasync def g(): await h()\n",
]


def _hf(folder: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(TARGET, local_files_only=True)


@pytest.fixture(scope="module")
def target() -> Any:
    return _hf(TARGET)


@pytest.fixture(scope="module")
def held_out_ids(tokenizer: Any) -> torch.Tensor:
    """``[1, 256]`` tokens of a held-out stdlib file (the shared-prefix workload's prompt)."""
    first = json.loads((WORKLOADS / "shared_prefix.jsonl").read_text().splitlines()[0])
    return torch.tensor(tokenizer(first["prompt"])["input_ids"][:256])[None]


@pytest.mark.parametrize("text", SNIPPETS)
def test_tokenizer_round_trips_python_code(tokenizer: Any, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert all(0 <= i < 4096 for i in ids)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text)  # BPE merges something


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert len(tokenizer) == 4096
    assert tokenizer.eos_token_id == 0 and tokenizer.bos_token_id == 0
    assert tokenizer.pad_token_id == 1
    assert tokenizer("def")["input_ids"][0] != 0  # no BOS is added
    for folder in (TARGET, DRAFT):
        assert (folder / "tokenizer.json").read_bytes() == (TARGET / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    ("folder", "architecture", "num_params"),
    [(TARGET, "Qwen3ForCausalLM", 14_163_328), (DRAFT, "LlamaForCausalLM", 1_573_824)],
)
def test_model_loads_through_transformers(
    folder: Path, architecture: str, num_params: int, held_out_ids: torch.Tensor
) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config["eos_token_id"] == 0 and config["tie_word_embeddings"] is True
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    model = _hf(folder)
    assert sum(p.numel() for p in model.parameters()) == num_params
    with torch.no_grad():
        logits = model(input_ids=held_out_ids[:, :32]).logits
    assert logits.shape == (1, 32, 4096)
    assert torch.isfinite(logits).all()


def test_engine_loader_matches_transformers(target: Any, held_out_ids: torch.Tensor) -> None:
    loader = pytest.importorskip("engine.model.loader")
    paged = pytest.importorskip("engine.model.paged_batch")
    model, _ = loader.load_model(TARGET, torch.float32, "cpu")
    ids = held_out_ids[0, :24]
    metadata, positions = paged.build_attention_metadata([0], [24], [[0, 1, 2]], 8, "cpu")
    with torch.no_grad():
        hidden = model(ids, positions, metadata, model.allocate_kv_caches(3, 8))  # [24, hidden]
        logits = model.compute_logits(hidden)
        expected = target(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def _documented_tensors(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensor table of samples/models/README.md."""
    hidden, inter, dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * dim, cfg["num_key_value_heads"] * dim
    layer = {
        "layer.input_layernorm.weight": (hidden,),
        "layer.self_attn.q_proj.weight": (q_dim, hidden),
        "layer.self_attn.k_proj.weight": (kv_dim, hidden),
        "layer.self_attn.v_proj.weight": (kv_dim, hidden),
        "layer.self_attn.o_proj.weight": (hidden, q_dim),
        "layer.self_attn.q_norm.weight": (dim,),
        "layer.self_attn.k_norm.weight": (dim,),
        "layer.post_attention_layernorm.weight": (hidden,),
        "layer.mlp.gate_proj.weight": (inter, hidden),
        "layer.mlp.up_proj.weight": (inter, hidden),
        "layer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
    }
    if cfg["architecture"] == EAGLE_ARCH:
        return {"fc.weight": (hidden, 2 * hidden), **layer}
    return {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
            "eh_proj.weight": (hidden, 2 * hidden), **layer}  # fmt: skip


@pytest.mark.parametrize(("folder", "architecture"), [(EAGLE, EAGLE_ARCH), (MTP, MTP_ARCH)])
def test_head_tensors_are_the_documented_ones(folder: Path, architecture: str) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    target_cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["architecture"] == architecture and cfg["target"] == "pycoder-14m"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "vocab_size"):  # fmt: skip
        assert cfg[key] == target_cfg[key], key
    assert cfg["rope_theta"] == target_cfg["rope_parameters"]["rope_theta"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    assert found == _documented_tensors(cfg)


@pytest.mark.parametrize("folder", [EAGLE, MTP])
def test_trained_heads_agree_with_the_target(
    folder: Path, target: Any, held_out_ids: torch.Tensor
) -> None:
    """Chained 2-step greedy agreement on held-out code, well above chance (1/4096)."""
    head = load_head(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = target.model(input_ids=held_out_ids).last_hidden_state  # post-norm [1, T, H]
        greedy = target.lm_head(hidden).argmax(-1)  # [1, T]: a_t
        embeds = target.model.embed_tokens(held_out_ids)
        g1, g2 = chain_head(head, embeds, hidden, 2)
        agree1 = (target.lm_head(g1).argmax(-1) == greedy[:, 1:]).float().mean().item()
        agree2 = (target.lm_head(g2).argmax(-1) == greedy[:, 2:]).float().mean().item()
    assert agree1 > 0.5 and agree2 > 0.45, (agree1, agree2)


@pytest.mark.parametrize("folder", [EAGLE, MTP])
def test_cache_style_second_step_agrees_too(
    folder: Path, target: Any, held_out_ids: torch.Tensor
) -> None:
    """The README's inference: step 2 at position t+1 attends to step-1 entries (built from the
    target's h) at positions <= t plus itself, fed ``g1_t``; teacher token ``x_{t+2}``, so that
    the target's greedy ``a_{t+2}`` is the right reference."""
    head = load_head(folder, dtype=torch.float32).eval()
    ids = held_out_ids[:, 96:144]  # past the licence-style header
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state  # [1, T, H]
        greedy = target.lm_head(hidden).argmax(-1)  # [1, T]
        embeds = target.model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1])
        g1 = head(embeds[:, 1:], hidden[:, :-1], positions[:-1])  # [1, T-1, H]
        hits = []
        for t in range(ids.shape[1] - 2):
            out = head(
                embeds[:, 1 : t + 3],  # x_1..x_{t+1} for the cache, x_{t+2} for step 2
                torch.cat((hidden[:, : t + 1], g1[:, t : t + 1]), 1),
                positions[: t + 2],
            )[:, -1]
            hits.append(target.lm_head(out).argmax(-1) == greedy[:, t + 2])
    agree2 = torch.cat(hits).float().mean().item()
    assert agree2 > 0.45, agree2


def test_trained_draft_and_target_predict_held_out_code(
    target: Any, held_out_ids: torch.Tensor
) -> None:
    draft = _hf(DRAFT)
    with torch.no_grad():
        logits = target(input_ids=held_out_ids).logits[0]  # [T, V]
        draft_logits = draft(input_ids=held_out_ids).logits[0]
    ce = torch.nn.functional.cross_entropy(logits[:-1], held_out_ids[0, 1:]).item()
    agree = (draft_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    assert ce < 3.6 and agree > 0.4, (ce, agree)


@pytest.mark.parametrize(("name", "count"), [("pycode_prompts.jsonl", 64),
                                             ("shared_prefix.jsonl", 16)])  # fmt: skip
def test_workloads_load(name: str, count: int, tokenizer: Any) -> None:
    workload = pytest.importorskip("engine.workload")
    requests = workload.load_jsonl(str(WORKLOADS / name))
    assert len(requests) == count
    assert 0.5 < requests[-1].arrival_time_s <= 2.0
    if name.startswith("shared"):
        prompts = [tokenizer(r.prompt)["input_ids"] for r in requests]
        common = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1)
        assert common >= 512  # a prefix long enough for several cached KV blocks
    else:
        assert {r.params.temperature for r in requests} == {0.0, 0.8}
        assert {r.params.max_tokens for r in requests} <= set(range(32, 129))
