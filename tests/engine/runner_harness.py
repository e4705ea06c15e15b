"""Shared pieces of the runner tests: a tiny random model and hand-built scheduler outputs."""

from __future__ import annotations

import torch

from engine.kernels.backend import create_kernel_backend
from engine.model.config import ModelConfig
from engine.model.loader import build_random_model
from engine.model.paged_batch import build_attention_metadata
from engine.sampling_params import SamplingParams
from engine.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def tiny_model(device: torch.device | str = "cpu", use_triton: bool = False):
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    model = build_random_model(
        config,
        torch.float32,
        device,
        seed=0,
        kernels=create_kernel_backend("triton" if use_triton else "torch"),
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # decisive logits: greedy ties cannot flip the argmax
    return model


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of one full-sequence forward with a fresh cache: [V] f32."""
    dev = model.lm_head.weight.device
    block_size = 4
    num_blocks = -(-len(tokens) // block_size)
    kv = model.allocate_kv_caches(num_blocks, block_size)
    md, positions = build_attention_metadata(
        [0], [len(tokens)], [list(range(num_blocks))], block_size, dev
    )
    hidden = model(torch.tensor(tokens, dtype=torch.int64, device=dev), positions, md, kv)
    return model.compute_logits(hidden[-1:])[0]


def reference_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        tokens.append(int(reference_logits(model, tokens).argmax()))
    return tokens[len(prompt) :]


def step_output(
    step: int,
    new: list[NewRequestData] = (),  # type: ignore[assignment]
    cached: list[tuple[str, list[int], int]] = (),  # type: ignore[assignment]
    tokens: dict[str, int] | None = None,
    finished: set[str] | None = None,
) -> SchedulerOutput:
    """``cached`` entries: (req_id, new block ids, frontier before this step)."""
    tokens = tokens or {}
    return SchedulerOutput(
        step=step,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[c[0] for c in cached],
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=dict(tokens),
        total_num_scheduled_tokens=sum(tokens.values()),
        finished_req_ids=finished or set(),
    )


def new_req(
    req_id: str, prompt: list[int], blocks: list[int], params=GREEDY, outputs=()
) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(outputs),
        sampling_params=params,
        block_ids=list(blocks),
        num_computed_tokens=0,
    )
