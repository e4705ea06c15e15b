"""Proposers: the contract, the per-step inputs the runner hands them, and the registry.

A proposer runs on the device right after the target's verify of step N, inside the same
enqueued step, and returns ``k`` drafts per request for positions ``P + 1 .. P + k`` (``P`` = the
position of the token verify just emitted, the bonus). The runner writes the drafts into the
state table's token row, where step N+1's input prep gathers them; the CPU only ever holds ``-1``
placeholders (the zero-bubble way: preparing N+1 needs no value from N).

Registry: :func:`create_proposer` builds one by method name (``draft``, ``eagle``, ``mtp``,
``ngram``); :func:`register_proposer` adds a method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import CacheConfig, ConfigError, SchedulerConfig, SpecConfig
from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend
from engine.kernels.noise import NoiseStream
from engine.model.layer_context import LayerContext

__all__ = [
    "DraftOutput",
    "ProposeInputs",
    "Proposer",
    "ProposerContext",
    "ProposerFactory",
    "create_proposer",
    "register_proposer",
    "sample_drafts",
]


@dataclass(frozen=True)
class ProposeInputs:
    """Everything a proposer may read for one step (device tensors unless noted).

    Batch position ``b`` (``num_reqs`` of them) is state row ``rows[b]``. ``anchor_token_idx[b]``
    is the flat query index of the last accepted token, whose target hidden state predicted the
    bonus token ``bonus_ids[b]`` now at position ``bonus_pos[b]``.
    """

    num_reqs: int  # host
    num_tokens: int  # host: query tokens of the step (unpadded)
    max_seq_len: int  # host: upper bound of any request's context after this step
    max_model_len: int  # host
    input_ids: torch.Tensor  # [>= T] int64: the target's query tokens
    positions: torch.Tensor  # [>= T] int64
    hidden_states: torch.Tensor  # [>= T, hidden]: the target's post-norm hidden states
    attn_metadata: AttentionMetadata  # the target's step (its block ids, positions, slots)
    rows: torch.Tensor  # [B] int64 state rows
    token_rows: torch.Tensor  # [>= T] int64: state row of each query token
    anchor_token_idx: torch.Tensor  # [B] int64
    bonus_ids: torch.Tensor  # [B] int64
    bonus_pos: torch.Tensor  # [B] int64
    block_table: torch.Tensor  # [B, max_blocks] int32: the rows' real KV blocks
    num_blocks: torch.Tensor  # [B] int32: blocks each row holds on the device this step
    token_ids: torch.Tensor  # [R + 1, max_model_len] int64: the state table's token rows
    temperature: torch.Tensor  # [B] f32 (0 = greedy)
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool  # host


@dataclass(frozen=True)
class DraftOutput:
    """``draft_ids: [B, k]`` int64; ``draft_probs: [B, k, V]`` f32 (the law each draft was drawn
    from), or None when the proposer has no distribution (n-gram) or every request is greedy."""

    draft_ids: torch.Tensor
    draft_probs: torch.Tensor | None


class Proposer(ABC):
    """Proposes ``num_spec_tokens`` drafts per request on the device, without host syncs."""

    num_spec_tokens: int

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> DraftOutput:
        """Drafts for positions ``bonus_pos + 1 .. bonus_pos + k``."""

    @property
    def has_draft_probs(self) -> bool:
        """True when drafts are drawn from a distribution the verify must divide by."""
        return True

    def kv_caches(self) -> list[torch.Tensor]:
        """The proposer's own paged KV caches ``[2, blocks, block_size, heads, head_dim]``
        (mirroring the target's blocks; none for a proposer without attention)."""
        return []


# stepscope: hot
def sample_drafts(
    logits: torch.Tensor,  # [B, V] f32 draft logits
    temperature: torch.Tensor,  # [B] f32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64: where each draft goes
    all_greedy: bool,
    kernels: KernelBackend,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens and the distribution ``q = softmax(logits / T)`` they were drawn from.

    Greedy rows take ``argmax`` (``q`` one-hot there); others use Gumbel-max with ``SAMPLE`` noise
    keyed by (seed, position). Returns ``(ids [B] int64, q [B, V] f32 or None if all greedy)``.
    """
    if all_greedy:
        return logits.argmax(dim=-1), None
    no_filter = torch.full_like(temperature, float("-inf"))
    ids = kernels.gumbel_sample(
        logits, temperature, no_filter, seeds, positions, NoiseStream.SAMPLE
    )
    greedy = temperature == 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    one_hot = torch.nn.functional.one_hot(ids, logits.shape[1]).to(probs.dtype)
    return ids, torch.where(greedy[:, None], one_hot, probs)


@dataclass(frozen=True)
class ProposerContext:
    """What every proposer is built from: the target, the layer context of its own layers (no
    tensor parallelism), and the engine config's parts as they are. ``spec.spec_model`` is
    resolved by the caller (MTP defaults to ``<target>/mtp``); ``cache`` and ``limits`` (the
    scheduler part) size the draft KV, which mirrors the target's paged cache."""

    target: Any  # the target LlamaForCausalLM
    spec: SpecConfig
    cache: CacheConfig
    limits: SchedulerConfig
    layers: LayerContext

    def require_spec_model(self, method: str, what: str) -> str:
        if self.spec.spec_model is None:
            raise ConfigError(f"spec_method={method!r} needs spec_model ({what})")
        return self.spec.spec_model


ProposerFactory = Callable[[ProposerContext], Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register_proposer(method: str, factory: ProposerFactory) -> None:
    """Make ``create_proposer(method, ctx)`` call ``factory(ctx)``."""
    _REGISTRY[method] = factory


def create_proposer(method: str, ctx: ProposerContext) -> Proposer:
    """Build the proposer ``method`` (``draft``, ``eagle``, ``mtp``, ``ngram``, or a registered one)."""
    _load_builtin_methods()
    if method not in _REGISTRY:
        raise ValueError(f"unknown spec method {method!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[method](ctx)


def _load_builtin_methods() -> None:
    """Import the built-in proposers once (they register themselves)."""
    from engine.spec import draft, eagle, mtp, ngram  # noqa: F401
