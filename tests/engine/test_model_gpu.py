"""On the H200: our bf16 logits (torch and Triton kernels) against transformers' bf16 eager."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.kernels.backend import create_kernel_backend
from engine.model.loader import load_model
from engine.model.paged_batch import build_attention_metadata
from tests.engine.test_model_llama import BLOCK_SIZE, PROMPT_LENS, SCHEDULE, _save_hf_model

pytestmark = pytest.mark.gpu


def _run_paged_cuda(model, sequences, schedule):
    rng = random.Random(0)
    max_blocks = [-(-len(s) // BLOCK_SIZE) for s in sequences]
    pool = list(range(sum(max_blocks) + 5))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in max_blocks]
    kv = model.allocate_kv_caches(len(pool) + sum(max_blocks), BLOCK_SIZE)
    computed = [0] * len(sequences)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        active = [i for i, n in enumerate(step) if n > 0]
        md, positions = build_attention_metadata(
            [computed[i] for i in active], [step[i] for i in active],
            [tables[i] for i in active], BLOCK_SIZE, "cuda", num_padded_tokens=None,
        )  # fmt: skip
        ids = [t for i in active for t in sequences[i][computed[i] : computed[i] + step[i]]]
        with torch.no_grad():
            logits = model.compute_logits(
                model(torch.tensor(ids, device="cuda"), positions, md, kv)
            )
        off = 0
        for i in active:
            out[i].append(logits[off : off + step[i]].float().cpu())
            off += step[i]
            computed[i] += step[i]
    return [torch.cat(c) for c in out]


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("name", ["llama", "qwen2_tied", "qwen3_head_dim_32"])
def test_bf16_logits_match_transformers(name: str, use_triton: bool, tmp_path: Path) -> None:
    import transformers

    _save_hf_model(name, tmp_path)
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", dtype=torch.bfloat16
        )
        .to("cuda")
        .eval()
    )
    model, _ = load_model(
        tmp_path,
        torch.bfloat16,
        "cuda",
        kernels=create_kernel_backend("triton" if use_triton else "torch"),
    )
    totals = [sum(step[i] for step in SCHEDULE) for i in range(len(PROMPT_LENS))]
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 97, (t,), generator=gen).tolist() for t in totals]
    ours = _run_paged_cuda(model, sequences, SCHEDULE)
    worst = 0.0
    for seq, got in zip(sequences, ours, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    print(f"{name} triton={use_triton}: max relative error {worst:.2e}")
    assert worst <= 2e-2
