"""TP=2 logits on the CPU, for tests/engine/test_tp.py: the spawned rank 1 imports only this
module (not the test module's analysis and engine imports: about 2 s less per spawn)."""

from __future__ import annotations

import torch

from engine.distributed.parallel_state import destroy_tp_group, init_tp_group
from engine.model.loader import load_model
from engine.model.paged_batch import build_attention_metadata

TIMEOUT_S = 60.0
BLOCK = 16


def paged_logits(model: torch.nn.Module) -> torch.Tensor:
    """Prefill of two prompts (one chunked), then a decode step; every position's logits."""
    kv = model.allocate_kv_caches(8, BLOCK)
    seqs = [list(range(3, 23)), list(range(40, 48))]
    tables = [[0, 1], [2]]
    out = []
    for computed, new in (([0, 0], [12, 7]), ([12, 7], [8, 1])):
        md, positions = build_attention_metadata(computed, new, tables, BLOCK, "cpu")
        ids = [t for s, c, n in zip(seqs, computed, new, strict=True) for t in s[c : c + n]]
        with torch.no_grad():
            hidden = model(torch.tensor(ids), positions, md, kv)
            out.append(model.compute_logits(hidden))  # [T, vocab]
    return torch.cat(out)


def tp_logits(rank: int, init_method: str, checkpoint: str) -> torch.Tensor:
    group = init_tp_group(rank, 2, init_method, None, TIMEOUT_S)
    try:
        model, _ = load_model(checkpoint, torch.float32, "cpu", tp=group)
        return paged_logits(model)
    finally:
        destroy_tp_group()


def rank1_logits(index: int, init_method: str, checkpoint: str) -> None:
    tp_logits(index + 1, init_method, checkpoint)
