"""Speculative decoding inside the runner's step: verify, commit, propose -- all on the device.

Step N's query for a decoding request is ``[x_S, d_1 .. d_k]`` at positions ``S .. S + k``: the
token sampled at step N-1 (``last_sampled``) and the drafts the proposer wrote into the state
table's token row after step N-1's verify. Input prep gathers both without the host. Then:

* **verify** (:class:`RejectionSampler`): accepted drafts + one recovered/bonus token per request;
* **commit**: emitted tokens into the token row, the last one into ``last_sampled``, and the
  device frontier rolled back by the rejected drafts (``num_computed -= k - num_accepted``); the
  rejected positions' KV is simply overwritten by a later step;
* **draft** (the proposer): ``k`` drafts for ``P + 1 .. P + k`` written into the token row (and
  their distribution into ``draft_probs``), where step N+1's input prep and verify read them.

The host learns tokens and ``num_accepted`` only from the d2h copy. The scheduler's ``-1``
placeholders never need values: preparing N+1 reads nothing from N (the zero-bubble way).

The runner sits a layer above (docs/design.md §1.2): the decoder reads the runner's state table
and host batch through the typed views :class:`SpecStates` and :class:`SpecBatch` (which
``RequestStates`` and ``InputBatch`` implement) and writes the table only through its named
operations (``commit_verified``, ``write_drafts``); the runner hands it a step's device views as
:class:`StepTensors`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.sample.logprobs import compute_topk_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler, SamplerOutput
from engine.sample.sampling_inputs import BatchFlags, SamplingRows, gather_sampling_metadata
from engine.spec.proposer import ProposeInputs, Proposer
from engine.spec.rejection import RejectionSampler, row_layout

__all__ = ["SpecBatch", "SpecDecoder", "SpecStates", "StepTensors"]


class DeviceColumns(Protocol):
    """A staged state-table tensor: its device copy."""

    @property
    def gpu(self) -> torch.Tensor: ...


class SpecStates(SamplingRows, Protocol):
    """What the spec decoder reads and writes of the state table (``RequestStates``)."""

    @property
    def max_num_reqs(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def trash_row(self) -> int: ...

    @property
    def last_sampled(self) -> torch.Tensor: ...  # [R + 1] int64

    @property
    def token_ids(self) -> DeviceColumns: ...  # [R + 1, max_model_len] int64

    @property
    def prefill_len(self) -> DeviceColumns: ...  # [R + 1, 1] int32: prompt + resumed outputs

    def sampling_column(self, name: str, rows: torch.Tensor) -> torch.Tensor: ...

    def commit_verified(
        self,
        token_rows: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        last_rows: torch.Tensor,
        last_tokens: torch.Tensor,
        frontier_rows: torch.Tensor,
        num_rejected: torch.Tensor,
        count_outputs: bool,
    ) -> None: ...

    def write_drafts(
        self, rows: torch.Tensor, positions: torch.Tensor, draft_ids: torch.Tensor
    ) -> None: ...


class SpecBatch(BatchFlags, Protocol):
    """The host description of one step that verify and propose read (``InputBatch``)."""

    @property
    def num_reqs(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_logits(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def num_drafts(self) -> int: ...

    @property
    def max_logits_per_req(self) -> int: ...


class StepTensors:
    """The runner's per-step device views the spec path reads (no copies)."""

    def __init__(
        self,
        input_ids: torch.Tensor,  # [>= T] int64
        positions: torch.Tensor,  # [>= T] int64
        logits_indices: torch.Tensor,  # [N] int64
        idx_mapping: torch.Tensor,  # [>= B] int32
        query_start_loc: torch.Tensor,  # [>= B + 1] int32
        cu_num_logits: torch.Tensor,  # [B + 1] int32
        logit_rows: torch.Tensor,  # [N] int64
        commit_rows: torch.Tensor,  # [N] int64
        num_blocks: torch.Tensor,  # [B] int32
        block_table: torch.Tensor,  # [>= B, max_blocks] int32
    ) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.logits_indices = logits_indices
        self.idx_mapping = idx_mapping
        self.query_start_loc = query_start_loc
        self.cu_num_logits = cu_num_logits
        self.logit_rows = logit_rows
        self.commit_rows = commit_rows
        self.num_blocks = num_blocks
        self.block_table = block_table


class SpecDecoder:
    """Owns the proposer, the rejection sampler and the per-row draft distributions."""

    def __init__(self, proposer: Proposer, states: SpecStates, sampler: Sampler) -> None:
        self.proposer = proposer
        self.states = states
        self.sampler = sampler
        self.num_spec_tokens = proposer.num_spec_tokens
        self.rejection = RejectionSampler(sampler)
        self.draft_probs: torch.Tensor | None = None  # [R + 1, k, V] f32
        if proposer.has_draft_probs:
            rows, vocab = states.max_num_reqs + 1, states.output_bin_counts.shape[1]
            self.draft_probs = torch.zeros(
                rows, self.num_spec_tokens, vocab, device=states.last_sampled.device
            )

    # stepscope: hot
    def verify(
        self, batch: SpecBatch, t: StepTensors, logits: torch.Tensor
    ) -> tuple[SamplerOutput, torch.Tensor]:
        """Verify (or plainly sample, when no request has drafts) and commit to the state table.

        logits: [N, V] f32. Returns the per-row output tokens (-1 after each request's stop) and
        ``num_accepted: [B]`` int64.
        """
        n = batch.num_logits
        sample_positions = t.positions[t.logits_indices] + 1  # [N]
        meta = gather_sampling_metadata(self.states, batch, t.logit_rows, sample_positions)
        if batch.num_drafts == 0:
            tokens = self.sampler.sample(logits, _no_logprobs(meta)).sampled_token_ids
            num_accepted = torch.zeros(batch.num_reqs, dtype=torch.int64, device=logits.device)
        else:
            draft_idx = (t.logits_indices + 1).clamp(max=batch.num_tokens - 1)
            draft_ids = t.input_ids[draft_idx]  # [N]: row l's draft d_{l+1}
            req, local = row_layout(t.cu_num_logits, n)
            if batch.any_penalties:
                meta = _count_drafts(meta, draft_ids, t.cu_num_logits, req, local)
            q = None
            if self.draft_probs is not None and not meta.all_greedy:
                q = self.draft_probs[t.logit_rows, local.clamp(max=self.num_spec_tokens - 1)]
            out = self.rejection.verify(
                logits, meta, draft_ids, q, t.cu_num_logits, batch.max_logits_per_req
            )
            tokens, num_accepted = out.token_ids, out.num_accepted
        self._commit(batch, t, sample_positions, tokens, num_accepted)
        return self._with_logprobs(logits, meta, tokens), num_accepted

    def _with_logprobs(
        self, logits: torch.Tensor, meta: SamplingMetadata, tokens: torch.Tensor
    ) -> SamplerOutput:
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=tokens)
        lp = compute_topk_logprobs(
            logits, meta.max_num_logprobs, tokens.clamp(min=0), self.sampler.kernels
        )
        return SamplerOutput(tokens, lp.token_ids, lp.logprobs, lp.ranks)

    # stepscope: hot
    def _commit(
        self,
        batch: SpecBatch,
        t: StepTensors,
        sample_positions: torch.Tensor,  # [N]
        tokens: torch.Tensor,  # [N], -1 after the stop
        num_accepted: torch.Tensor,  # [B]
    ) -> None:
        s, b, n = self.states, batch.num_reqs, batch.num_logits
        req, local = row_layout(t.cu_num_logits, n)
        trash = torch.full_like(t.commit_rows, s.trash_row)
        commit = torch.where(local <= num_accepted[req], t.commit_rows, trash)  # [N]
        cu = t.cu_num_logits.long()
        anchor = cu[:b] + num_accepted  # [B] logits row of the emitted last token
        s.commit_verified(
            token_rows=commit,
            positions=sample_positions,
            tokens=tokens,
            last_rows=t.commit_rows[cu[:b]],
            last_tokens=tokens[anchor],
            frontier_rows=t.idx_mapping[:b].long(),
            num_rejected=(cu[1:] - cu[:-1] - 1) - num_accepted,  # [B]
            count_outputs=batch.any_penalties,
        )

    # stepscope: hot
    def propose(
        self,
        batch: SpecBatch,
        t: StepTensors,
        hidden: torch.Tensor,  # [>= T, hidden] target post-norm hidden states
        attn_metadata: Any,
        tokens: torch.Tensor,  # [N] verify output
        num_accepted: torch.Tensor,  # [B]
    ) -> torch.Tensor:
        """Run the proposer; write drafts (and their law) where step N+1 reads them.

        Returns the drafts ``[B, k]`` int64 (the host reads them only for grammar checks)."""
        s, b = self.states, batch.num_reqs
        cu = t.cu_num_logits.long()
        anchor = cu[:b] + num_accepted  # [B]
        anchor_token = t.logits_indices[anchor]  # [B]
        rows = t.idx_mapping[:b].long()
        tp = attn_metadata.num_tokens
        tok = torch.arange(tp, device=rows.device)
        token_req = torch.searchsorted(t.query_start_loc[1 : b + 1].long(), tok, right=True)
        inputs = ProposeInputs(
            num_reqs=b,
            num_tokens=batch.num_tokens,
            max_seq_len=batch.max_seq_len,
            max_model_len=s.max_model_len,
            input_ids=t.input_ids,
            positions=t.positions,
            hidden_states=hidden,
            attn_metadata=attn_metadata,
            rows=rows,
            token_rows=rows[token_req.clamp(max=b - 1)],
            anchor_token_idx=anchor_token,
            bonus_ids=tokens[anchor],
            bonus_pos=t.positions[anchor_token] + 1,
            block_table=t.block_table[:b],
            num_blocks=t.num_blocks,
            token_ids=s.token_ids.gpu,
            temperature=s.sampling_column("temperature", rows),
            seeds=s.seeds_of(rows),
            all_greedy=batch.all_greedy,
        )
        out = self.proposer.propose(inputs)
        k = self.num_spec_tokens
        pos = inputs.bonus_pos[:, None] + 1 + torch.arange(k, device=rows.device)  # [B, k]
        dest = t.commit_rows[cu[:b]]  # [B]: trash for a request still prefilling
        s.write_drafts(dest, pos, out.draft_ids)
        if self.draft_probs is not None and out.draft_probs is not None:
            self.draft_probs[dest] = out.draft_probs
        return out.draft_ids


def _no_logprobs(meta: SamplingMetadata) -> SamplingMetadata:
    if meta.max_num_logprobs is None:
        return meta
    import dataclasses

    return dataclasses.replace(meta, max_num_logprobs=None)


# stepscope: hot
def _count_drafts(
    meta: SamplingMetadata,
    draft_ids: torch.Tensor,  # [N]
    cu_num_logits: torch.Tensor,  # [B + 1]
    req: torch.Tensor,  # [N]
    local: torch.Tensor,  # [N]
) -> SamplingMetadata:
    """Penalties of row ``l`` also count the drafts ``d_1 .. d_l`` before it (they are the
    tokens the request would have generated if every earlier draft is accepted)."""
    import dataclasses

    assert meta.output_bin_counts is not None
    cu = cu_num_logits.long()
    is_draft = (local < cu[req + 1] - cu[req] - 1).to(torch.int32)  # [N]
    vocab = meta.output_bin_counts.shape[1]
    one_hot = torch.nn.functional.one_hot(draft_ids, vocab).to(torch.int32) * is_draft[:, None]
    before = torch.cumsum(one_hot, dim=0) - one_hot  # [N, V]: drafts of rows < j
    extra = before - before[cu[req]]  # only this request's earlier rows
    counts = meta.output_bin_counts + extra.to(torch.int32)
    return dataclasses.replace(meta, output_bin_counts=counts)
