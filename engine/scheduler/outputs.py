"""Typed records that cross the scheduler / model-runner boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams

__all__ = [
    "NewRequestData",
    "CachedRequestData",
    "SchedulerOutput",
    "ModelRunnerOutput",
]


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or sees again after preemption: finish + re-add)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens already committed before a preemption; the runner treats prompt + these as the
    # prefix to (re)compute.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (tokens whose KV already sits in block_ids)


@dataclass(frozen=True)
class CachedRequestData:
    """Requests the runner already holds a row for; only the diff travels."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    num_computed_tokens: list[int] = field(default_factory=list)  # scheduler frontier at schedule


@dataclass(frozen=True)
class SchedulerOutput:
    """What one engine step runs: how many tokens each request advances and its KV blocks."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # includes the spec tokens to verify
    total_num_scheduled_tokens: int
    # Draft tokens to verify per request; -1 entries are drafts still on the device (async spec).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # free their rows before this step
    # Requests whose sampled token this step is discarded (still prefilling a chunk).
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the device returned for one step, after the host waited on its event."""

    step: int
    req_ids: list[str]
    # Per request, in req_ids order: accepted drafts + 1 sampled (or bonus) token; empty when the
    # request was mid-prefill (its chunk did not reach the end of the prompt).
    sampled_token_ids: list[list[int]]
    num_accepted: list[int] = field(default_factory=list)  # accepted drafts per request
    # Per request: per sampled token, a list of (token_id, logprob) for the top-k plus the sampled.
    logprobs: list[list[list[tuple[int, float]]]] | None = None
