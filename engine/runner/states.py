"""The request state table: stable rows of per-request device state, owned by the runner.

A request takes a row when it is added and keeps it until it finishes; preemption is finish +
re-add (the scheduler resends prompt + committed outputs). Per-step inputs are gathered from the
rows on the device through ``idx_mapping``; rows never move.

Device writes go through this class only: staged host diffs (:meth:`add`, :meth:`update_cached`,
:meth:`flush`/:meth:`apply`) and three named device operations run on the compute stream --
:meth:`commit_sampled`, :meth:`commit_verified` (with the frontier rollback) and
:meth:`write_drafts`. Readers take sampling columns by name (:meth:`sampling_column`,
:meth:`sampling_columns`); the column layout lives only in ``SAMPLING_F32_COLUMNS``.

Host books here are *mirrors* of what the device will hold once the enqueued work ran (prefill
length, frontier, number of blocks); they decide which diffs to stage and are never read back from
the device. Row ``max_num_reqs`` is a trash row: device scatters aimed at "no request" (a discarded
mid-prefill sample, a padded slot) land there, so no mask ever needs a host sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from engine.device import Device
from engine.kernels.backend import KernelBackend, TorchKernels
from engine.kernels.sampling import SampleCommitArgs
from engine.runner.staged_write import StagedFlush, StagedWriteTensor
from engine.sample.penalties import update_output_bin_counts
from engine.sampling_params import SamplingParams
from engine.scheduler.outputs import CachedRequestData, NewRequestData

__all__ = ["RequestStates", "SamplingFlags", "SAMPLING_F32_COLUMNS", "counter_seed"]

# Columns of the per-row float sampling table.
SAMPLING_F32_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")
_F32_COLUMN = {name: i for i, name in enumerate(SAMPLING_F32_COLUMNS)}
_MASK63 = (1 << 63) - 1


def counter_seed(base_seed: int, counter: int) -> int:
    """SplitMix64 of ``base_seed + counter``: the seed of the ``counter``-th unseeded request."""
    z = (base_seed + (counter + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class SamplingFlags(NamedTuple):
    """What a batch's rows ask of the sampler, all rows together."""

    any_penalties: bool
    all_greedy: bool
    no_top_k_top_p_min_p: bool
    max_num_logprobs: int | None


# A batch whose rows all sample greedily, without penalties, filters or logprobs (or no rows).
_PLAIN_GREEDY = SamplingFlags(
    any_penalties=False, all_greedy=True, no_top_k_top_p_min_p=True, max_num_logprobs=None
)


class RequestStates:
    """``max_num_reqs`` stable rows of device state plus the host books that address them."""

    def __init__(
        self,
        device: Device,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        seed: int = 0,
        kernels: KernelBackend | None = None,
        device_owns_frontier: bool = False,
    ) -> None:
        if min(max_num_reqs, max_model_len, max_blocks_per_req, vocab_size) <= 0:
            raise ValueError("state table sizes must be positive")
        self.device = device
        self.kernels = kernels or TorchKernels()
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # Speculative decoding: verify rolls rejected drafts back on the device, so the
        # scheduler's (possibly optimistic) frontier only resyncs the host mirror.
        self.device_owns_frontier = device_owns_frontier
        self.trash_row = max_num_reqs
        rows = max_num_reqs + 1
        dev = device.torch_device

        def staged(cols: int, dtype: torch.dtype, fill: float | int = 0) -> StagedWriteTensor:
            return StagedWriteTensor(device, (rows, cols), dtype, fill=fill, kernels=kernels)

        # Staged from the host (diffs only).
        self.token_ids = staged(max_model_len, torch.int64)  # [R+1, max_model_len]
        self.block_table = staged(max_blocks_per_req, torch.int32)  # [R+1, max_blocks]
        self.num_computed = staged(1, torch.int32)  # [R+1, 1]: frontier, advanced on device
        self.prefill_len = staged(1, torch.int32)  # [R+1, 1]: prompt + resumed outputs
        self.sampling_f32 = staged(len(SAMPLING_F32_COLUMNS), torch.float32)  # [R+1, 6]
        self.top_k = staged(1, torch.int32)  # [R+1, 1]
        self.seeds = staged(1, torch.int64)  # [R+1, 1]
        self._staged = (
            self.token_ids,
            self.block_table,
            self.num_computed,
            self.prefill_len,
            self.sampling_f32,
            self.top_k,
            self.seeds,
        )
        # Fixed views the fused sampler reads (the staged tensors never move).
        self._temperature_col = self.sampling_f32.gpu[:, _F32_COLUMN["temperature"]]  # [R+1]
        self._seeds_col = self.seeds.gpu[:, 0]  # [R+1]
        # Written only by device work.
        self.last_sampled = torch.zeros(rows, dtype=torch.int64, device=dev)  # [R+1]
        self.output_bin_counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=dev)
        self.prompt_bin_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)

        self._free_rows = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out row 0 first
        self.row_of: dict[str, int] = {}
        self.params: list[SamplingParams | None] = [None] * rows
        self.prompt_len_cpu = np.zeros(rows, np.int64)
        self.prefill_len_cpu = np.zeros(rows, np.int64)
        self.num_computed_cpu = np.zeros(rows, np.int64)  # device frontier once enqueued work ran
        self.num_blocks_cpu = np.zeros(rows, np.int64)
        # What each row's SamplingParams asks beyond plain greedy sampling (set when the row is
        # staged, cleared when it is freed), and how many rows ask anything: while none does, a
        # step's sampling switches are known without reading its rows.
        self._penalised_cpu = np.zeros(rows, np.bool_)
        self._random_cpu = np.zeros(rows, np.bool_)  # temperature > 0
        self._filtered_cpu = np.zeros(rows, np.bool_)  # top-k, top-p or min-p
        self._num_logprobs_cpu = np.full(rows, -1, np.int64)  # -1: no logprobs
        self._num_rows_beyond_greedy = 0
        self._base_seed = seed
        self._num_unseeded = 0
        self._penalty_rows_to_init: list[int] = []
        # The rows of the last batch looked up (a steady decode step runs the same requests in
        # the same order as the one before): (req_ids, rows); dropped when any row changes.
        self._rows_cache: tuple[list[str], np.ndarray] | None = None

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """The state rows of ``req_ids`` (each must hold one), int64 ``[len(req_ids)]``; read-only.

        Looked up once per change of the batch: the same requests in the same order as the last
        call (a steady decode step) reuse its rows."""
        cached = self._rows_cache
        if cached is not None and cached[0] == req_ids:
            return cached[1]
        row_of = self.row_of
        rows = np.fromiter((row_of[r] for r in req_ids), np.int64, len(req_ids))
        rows.flags.writeable = False
        self._rows_cache = (list(req_ids), rows)
        return rows

    def remove(self, req_ids: Iterable[str]) -> None:
        """Free the rows of finished (or preempted) requests; unknown ids are ignored."""
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self._rows_cache = None
                self.params[row] = None
                self._set_sampling_flags(row, None)
                self._free_rows.append(row)

    def add(self, new: NewRequestData) -> int:
        """Take a row for a new (or resumed) request and stage its whole state."""
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} already holds row {self.row_of[new.req_id]}")
        if not self._free_rows:
            raise RuntimeError(f"state table full ({self.max_num_reqs} rows)")
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        if len(tokens) > self.max_model_len:
            raise ValueError(f"{len(tokens)} tokens exceed max_model_len={self.max_model_len}")
        row = self._free_rows.pop()
        self.row_of[new.req_id] = row
        self._rows_cache = None
        self.token_ids.stage(row, 0, tokens)
        self.prefill_len.stage(row, 0, [len(tokens)])
        self.num_computed.stage(row, 0, [new.num_computed_tokens])
        self.prompt_len_cpu[row] = len(new.prompt_token_ids)
        self.prefill_len_cpu[row] = len(tokens)
        self.num_computed_cpu[row] = new.num_computed_tokens
        self.num_blocks_cpu[row] = 0
        self._append_blocks(row, new.block_ids)
        self._stage_sampling(row, new.sampling_params)
        return row

    def update_cached(self, cached: CachedRequestData) -> None:
        """Append new blocks; stage a frontier only where the scheduler disagrees with the mirror."""
        rows = self.rows_of(cached.req_ids)
        # A missing entry (a shorter list) means "no change", as an empty one does.
        for index, block_ids in enumerate(cached.new_block_ids[: rows.shape[0]]):
            if block_ids:  # one request in block_size per decode step
                self._append_blocks(int(rows[index]), block_ids)
        # Only the rows whose frontier disagrees with the mirror (none in a steady decode step).
        frontiers = np.asarray(cached.num_computed_tokens, np.int64)  # [n]
        rows = rows[: frontiers.shape[0]]
        changed = np.flatnonzero(self.num_computed_cpu[rows] != frontiers)
        for row, frontier in zip(rows[changed].tolist(), frontiers[changed].tolist(), strict=True):
            if not self.device_owns_frontier:
                self.num_computed.stage(row, 0, [frontier])
            self.num_computed_cpu[row] = frontier

    def advance(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """Mirror the input-prep kernel's ``num_computed[rows] += num_tokens`` (distinct rows)."""
        self.num_computed_cpu[rows] += num_tokens

    def sampling_flags(self, rows: np.ndarray | list[int]) -> SamplingFlags:
        """The sampler's batch-wide switches for these rows (rows holding requests)."""
        if self._num_rows_beyond_greedy == 0 or len(rows) == 0:
            # No live row asks for more than plain greedy sampling, so no row of the batch does.
            return _PLAIN_GREEDY
        index = np.asarray(rows, np.int64)  # [b]
        most_logprobs = int(self._num_logprobs_cpu[index].max())
        return SamplingFlags(
            any_penalties=bool(self._penalised_cpu[index].any()),
            all_greedy=not self._random_cpu[index].any(),
            no_top_k_top_p_min_p=not self._filtered_cpu[index].any(),
            max_num_logprobs=most_logprobs if most_logprobs >= 0 else None,
        )

    def logprobs_asked(self, rows: np.ndarray | list[int]) -> np.ndarray:
        """Per row: does its request ask for logprobs? ``[len(rows)]`` bool (host)."""
        return self._num_logprobs_cpu[np.asarray(rows, np.int64)] >= 0

    def _set_sampling_flags(self, row: int, p: SamplingParams | None) -> None:
        """Record what ``p`` asks of the sampler for this row (None: the row was freed and asks
        nothing), keeping the count of rows that ask for more than plain greedy sampling."""
        self._num_rows_beyond_greedy -= self._beyond_greedy(row)
        self._penalised_cpu[row] = p is not None and p.has_penalties
        self._random_cpu[row] = p is not None and not p.is_greedy
        self._filtered_cpu[row] = p is not None and (
            p.top_k > 0 or p.top_p != 1.0 or p.min_p != 0.0
        )
        self._num_logprobs_cpu[row] = -1 if p is None or p.logprobs is None else p.logprobs
        self._num_rows_beyond_greedy += self._beyond_greedy(row)

    def _beyond_greedy(self, row: int) -> bool:
        return bool(
            self._penalised_cpu[row]
            or self._random_cpu[row]
            or self._filtered_cpu[row]
            or self._num_logprobs_cpu[row] >= 0
        )

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks_cpu[row])
            self.block_table.stage(row, start, block_ids)
            self.num_blocks_cpu[row] = start + len(block_ids)

    def _stage_sampling(self, row: int, p: SamplingParams) -> None:
        self.params[row] = p
        self._set_sampling_flags(row, p)
        values = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "repetition": p.repetition_penalty,
            "presence": p.presence_penalty,
            "frequency": p.frequency_penalty,
        }
        self.sampling_f32.stage(row, 0, [values[name] for name in SAMPLING_F32_COLUMNS])
        self.top_k.stage(row, 0, [max(p.top_k, 0)])
        if p.seed is not None:
            seed = p.seed
        else:
            seed = counter_seed(self._base_seed, self._num_unseeded)
            self._num_unseeded += 1
        self.seeds.stage(row, 0, [seed])
        if p.has_penalties:
            self._penalty_rows_to_init.append(row)

    # stepscope: hot
    def flush(self) -> list[StagedFlush | None]:
        """Pack and enqueue every staged diff on the h2d stream (one entry per staged tensor)."""
        return self.copy(self.pack())

    # stepscope: hot
    def pack(self) -> list[StagedFlush | None]:
        """Host only: pack every staged diff into its table's ring slot (:meth:`copy` next)."""
        return [table.pack() for table in self._staged]

    # stepscope: hot
    def copy(self, flushes: list[StagedFlush | None]) -> list[StagedFlush | None]:
        """Enqueue the h2d copies of :meth:`pack`'s flushes; returns them for :meth:`apply`."""
        for table, flush in zip(self._staged, flushes, strict=True):
            table.copy(flush)
        return flushes

    # stepscope: hot
    def apply(self, flushes: list[StagedFlush | None]) -> None:
        """Enqueue the apply kernels, then (re)build penalty state of newly added rows."""
        for table, flush in zip(self._staged, flushes, strict=True):
            table.apply(flush)
        for row in self._penalty_rows_to_init:
            self._enqueue_penalty_init(row)
        self._penalty_rows_to_init = []

    def _enqueue_penalty_init(self, row: int) -> None:
        """Device: prompt mask and output counts of a (possibly resumed) row from its token row."""
        prompt_len, prefill_len = int(self.prompt_len_cpu[row]), int(self.prefill_len_cpu[row])
        tokens, counts, mask = self.token_ids.gpu, self.output_bin_counts, self.prompt_bin_mask

        def init() -> None:
            mask[row].zero_()
            mask[row].index_fill_(0, tokens[row, :prompt_len], True)
            counts[row].zero_()
            outputs = tokens[row, prompt_len:prefill_len]
            counts[row].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))

        self.device.submit(self.device.compute_stream, init)

    # ---- device reads by name -------------------------------------------------------------
    # stepscope: hot
    def sampling_column(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Device: column ``name`` of ``SAMPLING_F32_COLUMNS`` for ``rows: [N]``. [N] f32."""
        return self.sampling_f32.gpu[rows][:, _F32_COLUMN[name]].contiguous()

    # stepscope: hot
    def sampling_columns(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Device: every ``SAMPLING_F32_COLUMNS`` column of ``rows: [N]`` by name, [N] f32 each
        (one gather)."""
        f32 = self.sampling_f32.gpu[rows]  # [N, len(SAMPLING_F32_COLUMNS)]
        return {name: f32[:, i].contiguous() for name, i in _F32_COLUMN.items()}

    # stepscope: hot
    def top_k_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Device: ``top_k`` of ``rows: [N]``. [N] int32."""
        return self.top_k.gpu[rows, 0].contiguous()

    # stepscope: hot
    def seeds_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Device: the noise seeds of ``rows: [N]``. [N] int64."""
        return self.seeds.gpu[rows, 0].contiguous()

    # ---- device writes (compute stream) -----------------------------------------------------
    # stepscope: hot
    def commit_sampled(
        self,
        rows: torch.Tensor,  # [N] int64; the trash row for discarded samples
        positions: torch.Tensor,  # [N] int64: where each sampled token goes
        sampled: torch.Tensor,  # [N] int64
        count_outputs: bool,
    ) -> None:
        """Sampled tokens into ``last_sampled`` and their token rows, where the next step's
        input prep reads them; ``count_outputs``: also into the penalty counts."""
        self.last_sampled[rows] = sampled
        cols = positions.clamp(max=self.max_model_len - 1)
        self.token_ids.gpu[rows, cols] = sampled
        if count_outputs:
            update_output_bin_counts(self.output_bin_counts, rows, sampled)

    # stepscope: hot
    def sample_and_commit(
        self,
        logits: torch.Tensor,  # [N, V] f32
        logit_rows: torch.Tensor,  # [N] int32: the row each logits row samples for
        commit_rows: torch.Tensor,  # [N] int32; the trash row for discarded samples
        logits_indices: torch.Tensor,  # [N] int64: each logits row's token
        positions: torch.Tensor,  # [>= T] int64: the step's token positions
        keep_threshold: torch.Tensor | None,  # [N] f32 (top-k/p, min-p); None: keep all
        all_greedy: bool,
    ) -> torch.Tensor:
        """Plain sampling (no row penalises) fused with :meth:`commit_sampled`: each logits row
        samples with its row's temperature and seed at its token's position + 1, and the token
        lands where ``commit_sampled`` puts it; one kernel (docs/design.md §2.7). [N] int64."""
        return self.kernels.sample_commit(
            SampleCommitArgs(
                logits=logits,
                logit_rows=logit_rows,
                commit_rows=commit_rows,
                logits_indices=logits_indices,
                positions=positions,
                temperature=self._temperature_col,
                seeds=self._seeds_col,
                keep_threshold=keep_threshold,
                last_sampled=self.last_sampled,
                token_ids=self.token_ids.gpu,
                all_greedy=all_greedy,
            )
        )

    # stepscope: hot
    def commit_verified(
        self,
        token_rows: torch.Tensor,  # [N] int64: each logits row's state row; trash = not emitted
        positions: torch.Tensor,  # [N] int64: where each emitted token goes
        tokens: torch.Tensor,  # [N] int64, -1 after the stop
        last_rows: torch.Tensor,  # [B] int64: each request's row (trash while prefilling)
        last_tokens: torch.Tensor,  # [B] int64: each request's last emitted token
        frontier_rows: torch.Tensor,  # [B] int64: each request's row
        num_rejected: torch.Tensor,  # [B]: drafts rejected per request
        count_outputs: bool,
    ) -> None:
        """Verified tokens into the token rows, each request's last one into ``last_sampled``,
        and the device frontier rolled back: ``num_computed[r] -= num_rejected`` (the rejected
        positions' KV is overwritten later). ``count_outputs``: also the penalty counts."""
        cols = positions.clamp(max=self.max_model_len - 1)
        self.token_ids.gpu[token_rows, cols] = tokens
        self.last_sampled[last_rows] = last_tokens
        nc = self.num_computed.gpu[:, 0]
        nc[frontier_rows] = nc[frontier_rows] - num_rejected.to(nc.dtype)
        if count_outputs:
            update_output_bin_counts(self.output_bin_counts, token_rows, tokens.clamp(min=0))

    # stepscope: hot
    def write_drafts(
        self,
        rows: torch.Tensor,  # [B] int64 (trash for a request still prefilling)
        positions: torch.Tensor,  # [B, k] int64: where each draft goes
        draft_ids: torch.Tensor,  # [B, k] int64
    ) -> None:
        """Drafts into the token rows, where the next step's input prep and verify read them;
        a draft past ``max_model_len`` goes to the trash row."""
        inside = positions < self.max_model_len
        dest = torch.where(inside, rows[:, None], torch.full_like(positions, self.trash_row))
        self.token_ids.gpu[dest, positions.clamp(max=self.max_model_len - 1)] = draft_ids
