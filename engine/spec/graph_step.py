"""Verify and propose over a padded speculative step: the bodies CUDA graphs capture.

The runner pads a speculative step to a captured shape: ``Bp`` requests, ``T`` tokens and ``N``
logits rows (``N = min(T, Bp * (1 + k))``, every request verifying at most ``k`` drafts). The
step may be ragged: decodes with ``k`` drafts, decodes whose drafts were trimmed near
``max_tokens``, prefill chunks. Everything here is a function of ``(Bp, T, N)`` and of device
buffers at fixed addresses; no host int changes between steps of one shape:

* ``idx_mapping [Bp]`` and ``query_start_loc [Bp + 1]`` sit at fixed offsets of the staged packed
  batch (padded requests: the trash row, no query token); ``cu_num_logits`` starts at a fixed
  offset too but only its first ``b + 1`` entries are this step's, so the logits layout is rebuilt
  on the device from the live requests (``query_start_loc[i+1] > query_start_loc[i]``);
* whether a request returns a token (its prefill is done) is ``seq_len >= prefill_len[row]``, the
  rule of ``build_input_batch``, read on the device;
* logits rows past the step's (``cu[Bp] .. N``) belong to one extra, ignored request, so every
  scan and gather stays in range; their tokens, like padded requests' work, land in the trash
  row;
* the draft chain's real blocks are ``ceil(seq_len / block_size)``: every position below
  ``seq_len`` is in them and later chain positions use the row's lookahead blocks
  (``LookaheadKV``). The eager path counts the blocks the scheduler allocated instead, which
  places chain KV differently but computes the same drafts.

Host bounds are the shape's: ``max_query_len = T``, ``max_seq_len = max_model_len``. The same
functions run eagerly on the CPU (tests) and inside the captured graphs on CUDA
(docs/design.md §2.6, "Speculative graphs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.attention_metadata import AttentionMetadata
from engine.sample.sampling_inputs import gather_sampling_metadata
from engine.spec.decoder import SpecDecoder
from engine.spec.proposer import ProposeInputs

__all__ = ["GraphFlags", "GraphLayout", "PaddedSpecStep", "StepBuffers"]


@dataclass(frozen=True)
class GraphFlags:
    """The host sampling switches a graph is captured for (``BatchFlags``): greedy, or random
    sampling with temperature only; penalties, filters and logprobs run eagerly."""

    all_greedy: bool
    any_penalties: bool = False
    no_top_k_top_p_min_p: bool = True
    max_num_logprobs: int | None = None


@dataclass(frozen=True)
class StepBuffers:
    """The runner's persistent device buffers a padded step reads (fixed addresses)."""

    input_ids: torch.Tensor  # [>= T] int64
    positions: torch.Tensor  # [>= T] int64
    seq_lens: torch.Tensor  # [>= Bp] int32
    logits_indices: torch.Tensor  # [>= N] int64 (this step's first n entries valid)
    packed: torch.Tensor  # [capacity] int32: the staged packed batch
    block_table: torch.Tensor  # [>= Bp, max_blocks] int32: the gathered block table


@dataclass(frozen=True)
class GraphLayout:
    """One step's logits layout, rebuilt on the device (shapes depend on ``(Bp, T, N)`` only)."""

    rows: torch.Tensor  # [Bp] int64 state rows (trash for padded requests)
    live: torch.Tensor  # [Bp] bool: a real request of this step
    num_logits: torch.Tensor  # [Bp] int64 logits rows per request (0 when padded)
    cu: torch.Tensor  # [Bp + 2] int64: request i's rows cu[i]..cu[i+1]; the last owns padding
    req: torch.Tensor  # [N] int64: request of each logits row (Bp = the padding request)
    local: torch.Tensor  # [N] int64: index inside its request
    valid: torch.Tensor  # [N] bool: a real logits row
    token_idx: torch.Tensor  # [N] int64: query token of each row (0 for padding rows)
    commit_req: torch.Tensor  # [Bp] int64: the row a request's tokens go to (trash: none)


class PaddedSpecStep:
    """Verify + commit and propose + write drafts over a padded (possibly ragged) step."""

    def __init__(self, spec: SpecDecoder, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.k = spec.num_spec_tokens

    # stepscope: hot
    def layout(self, t: StepBuffers, num_reqs: int, num_rows: int) -> GraphLayout:
        """The logits layout of ``num_reqs`` padded requests and ``num_rows`` padded rows."""
        s, bp, n = self.spec.states, num_reqs, num_rows
        dev = t.input_ids.device
        rows = t.packed[:bp].long()
        qsl = t.packed[bp : 2 * bp + 1].long()
        raw_cu = t.packed[2 * bp + 1 : 3 * bp + 2].long()  # the first b + 1 entries are real
        live = qsl[1:] > qsl[:-1]  # [Bp]
        num_logits = torch.where(live, raw_cu[1:] - raw_cu[:-1], torch.zeros_like(rows))
        # [0, cumsum, n], built on the device: ``cu[bp + 1] = n`` would copy a host scalar
        # (not capturable).
        zero1, n1 = torch.zeros(1, dtype=torch.int64, device=dev), torch.full_like(rows[:1], n)
        cu = torch.cat([zero1, torch.cumsum(num_logits, 0), n1])
        flat = torch.arange(n, device=dev)
        req = torch.searchsorted(cu[1:], flat, right=True)  # [N] in [0, Bp]
        valid = req < bp
        req_c = req.clamp(max=bp - 1)
        zero = torch.zeros_like(flat)
        token_idx = torch.where(valid, t.logits_indices[:n], zero)
        returns = t.seq_lens[:bp] >= s.prefill_len.gpu[rows, 0]  # [Bp]: its prefill is done
        trash = torch.full_like(rows, s.trash_row)
        return GraphLayout(
            rows=rows,
            live=live,
            num_logits=num_logits,
            cu=cu,
            req=req_c,
            local=flat - cu[req],
            valid=valid,
            token_idx=token_idx,
            commit_req=torch.where(live & returns, rows, trash),
        )

    # stepscope: hot
    def verify(
        self, t: StepBuffers, lay: GraphLayout, logits: torch.Tensor, flags: GraphFlags
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify every request's drafts (or sample its one row) and commit to the state table.

        logits: [N, V] f32 (row j = query token ``lay.token_idx[j]``). Returns ``tokens: [N]``
        int64 (accepted drafts, then the recovered/bonus token, then -1; -1 on padding rows,
        which the scan leaves unwritten) and ``num_accepted: [Bp]`` int64 (0 for padded
        requests)."""
        spec, states = self.spec, self.spec.states
        n, bp = logits.shape[0], lay.rows.shape[0]
        trash = states.trash_row
        logit_rows = torch.where(lay.valid, lay.rows[lay.req], torch.full_like(lay.req, trash))
        sample_positions = t.positions[lay.token_idx] + 1  # [N]: where each row's token goes
        meta = gather_sampling_metadata(states, flags, logit_rows, sample_positions)
        last_token = t.input_ids.shape[0] - 1
        draft_ids = t.input_ids[(lay.token_idx + 1).clamp(max=last_token)]  # [N]: d_{l+1}
        q_probs = None
        if spec.draft_probs is not None and not flags.all_greedy:
            q_probs = spec.draft_probs[logit_rows, lay.local.clamp(0, self.k - 1)]  # [N, V]
        out = spec.rejection.verify(logits, meta, draft_ids, q_probs, lay.cu, 1 + self.k)
        zero = torch.zeros_like(lay.rows)
        num_accepted = torch.where(lay.live, out.num_accepted[:bp], zero)  # [Bp]
        # Rows past a request's stop (-1) and padding rows (garbage) are committed to the trash
        # row only; clamped into the vocabulary there, the proposer may embed what it reads back.
        tokens = out.token_ids.clamp(0, states.output_bin_counts.shape[1] - 1)  # [N]
        emitted = lay.valid & (lay.local <= num_accepted[lay.req])  # [N]
        commit_rows = lay.commit_req[lay.req]  # [N]
        anchor = (lay.cu[:bp] + num_accepted).clamp(max=n - 1)  # [Bp]: last emitted row
        states.commit_verified(
            token_rows=torch.where(emitted, commit_rows, torch.full_like(commit_rows, trash)),
            positions=sample_positions,
            tokens=tokens,
            last_rows=lay.commit_req,
            last_tokens=tokens[anchor],
            frontier_rows=lay.rows,
            num_rejected=torch.where(lay.live, lay.num_logits - 1 - num_accepted, zero),
            count_outputs=False,
        )
        # Padding rows hold whatever the scan's output buffer held (on CUDA: stale memory, any
        # int64); a later gather by token id (logprobs) would index out of bounds with it.
        return torch.where(
            lay.valid, out.token_ids, torch.full_like(out.token_ids, -1)
        ), num_accepted

    # stepscope: hot
    def propose(
        self,
        t: StepBuffers,
        lay: GraphLayout,
        hidden: torch.Tensor,  # [T, hidden] the target's post-norm hidden states
        attn_metadata: AttentionMetadata,  # the target's step over the padded shape
        tokens: torch.Tensor,  # [N] verify output
        num_accepted: torch.Tensor,  # [Bp]
        all_greedy: bool,
    ) -> torch.Tensor:
        """Run the proposer; write the next step's drafts (and their law) into the state table.
        Returns ``draft_ids: [Bp, k]`` int64."""
        spec, states, k = self.spec, self.spec.states, self.k
        bp, n, tp = lay.rows.shape[0], tokens.shape[0], attn_metadata.num_tokens
        dev = hidden.device
        anchor = (lay.cu[:bp] + num_accepted).clamp(max=n - 1)  # [Bp]
        anchor_token = lay.token_idx[anchor]  # [Bp]
        bonus_pos = t.positions[anchor_token] + 1  # [Bp]
        qsl = t.packed[bp + 1 : 2 * bp + 1].long()  # [Bp]: query ends
        token_req = torch.searchsorted(qsl, torch.arange(tp, device=dev), right=True)  # [T]
        # Padding tokens read a real row (row 0 of the batch always is one): the trash row holds
        # no valid token ids for the proposer's embedding.
        token_live = lay.live[token_req.clamp(max=bp - 1)] & (token_req < bp)
        token_rows = torch.where(token_live, lay.rows[token_req.clamp(max=bp - 1)], lay.rows[0])
        bonus_ids = torch.where(lay.live, tokens[anchor], torch.zeros_like(anchor))  # [Bp]
        bs = self.block_size
        inputs = ProposeInputs(
            num_reqs=bp,
            num_tokens=tp,
            max_seq_len=states.max_model_len,  # a bound every step of the shape meets
            max_model_len=states.max_model_len,
            input_ids=t.input_ids,
            positions=t.positions,
            hidden_states=hidden,
            attn_metadata=attn_metadata,
            rows=lay.rows,
            token_rows=token_rows,
            anchor_token_idx=anchor_token,
            bonus_ids=bonus_ids,
            bonus_pos=bonus_pos,
            block_table=t.block_table[:bp],
            num_blocks=torch.div(t.seq_lens[:bp] + (bs - 1), bs, rounding_mode="floor"),
            token_ids=states.token_ids.gpu,
            temperature=states.sampling_column("temperature", lay.rows),
            seeds=states.seeds_of(lay.rows),
            all_greedy=all_greedy,
        )
        out = spec.proposer.propose(inputs)
        pos = bonus_pos[:, None] + 1 + torch.arange(k, device=dev)  # [Bp, k]
        states.write_drafts(lay.commit_req, pos, out.draft_ids)
        if spec.draft_probs is not None and out.draft_probs is not None:
            spec.draft_probs[lay.commit_req] = out.draft_probs
        return out.draft_ids
