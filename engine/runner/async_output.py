"""The handle ``execute_model`` returns: device results still in flight to host memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from engine.device import DeviceEvent
from engine.runner.input_batch import InputBatch
from engine.runner.step_in_flight import StepInFlight
from engine.scheduler.outputs import ModelRunnerOutput

__all__ = ["AsyncOutput", "HostOutputBuffers", "PendingSample", "SampledBufferPool"]


@dataclass(frozen=True)
class HostOutputBuffers:
    """Host tensors (pinned on CUDA) the d2h copy of one step writes into."""

    sampled: torch.Tensor  # [num_logits] int64
    num_accepted: torch.Tensor | None  # [num_reqs] int64, speculative decoding only
    logprob_token_ids: torch.Tensor | None  # [num_logits, k + 1] int64
    logprobs: torch.Tensor | None  # [num_logits, k + 1] f32
    # [num_reqs, num_spec_tokens] int64: the drafts the next step verifies (structured + spec:
    # the grammar walks them to build the next step's per-draft-position bitmask rows)
    draft_ids: torch.Tensor | None = None
    # the pooled buffer ``sampled`` is a view of (given back once the output is read), or None
    sampled_base: torch.Tensor | None = None
    # [num_reqs] bool: the requests that asked for logprobs (None: every request gets them)
    logprobs_asked: np.ndarray | None = None


class SampledBufferPool:
    """Host buffers for one step's output, reused once it has been read.

    A buffer (int64, pinned on CUDA) holds, one after the other: ``capacity`` sampled tokens,
    ``num_counts`` accepted counts (speculative decoding) and ``capacity x logprob_cols``
    logprob token ids and float32 logprobs. A step takes contiguous views of it (the first
    ``num_logits`` entries; :meth:`counts`; :meth:`logprob_views`) and :meth:`AsyncOutput.get`
    gives the buffer back after converting it to Python numbers, so steady steps allocate no
    host memory (and on CUDA skip the pinned allocator's per-allocation event bookkeeping). A
    buffer never given back (an output nobody read) is simply left to the garbage collector; an
    empty pool allocates a new one.
    """

    def __init__(
        self,
        host_empty: Callable[..., torch.Tensor],
        capacity: int,
        num_counts: int = 0,
        logprob_cols: int = 0,
    ) -> None:
        self._host_empty = host_empty
        self.capacity = capacity
        self.num_counts = num_counts
        self.logprob_cols = logprob_cols
        self._ids_at = capacity + num_counts
        self._values_at = self._ids_at + capacity * logprob_cols
        # float32 logprobs packed two per int64 slot
        self._size = self._values_at + (capacity * logprob_cols + 1) // 2
        self._free: list[torch.Tensor] = []
        self.num_allocated = 0

    def take(self) -> torch.Tensor:
        """A free buffer (int64, flat)."""
        if self._free:
            return self._free.pop()
        self.num_allocated += 1
        return self._host_empty((self._size,), torch.int64)

    def counts(self, buffer: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """The accepted-count view of a taken buffer: ``[num_reqs]`` int64."""
        if num_reqs > self.num_counts:
            raise ValueError(f"{num_reqs} requests > the pool's {self.num_counts} count slots")
        return buffer[self.capacity : self.capacity + num_reqs]

    def fits_logprobs(self, num_rows: int, num_cols: int) -> bool:
        return num_rows <= self.capacity and num_cols <= self.logprob_cols

    def logprob_views(
        self, buffer: torch.Tensor, num_rows: int, num_cols: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``[num_rows, num_cols]`` views of a taken buffer: token ids (int64) and
        logprobs (float32); needs :meth:`fits_logprobs`."""
        if not self.fits_logprobs(num_rows, num_cols):
            raise ValueError(f"logprobs [{num_rows}, {num_cols}] exceed the pool's buffers")
        m = num_rows * num_cols
        ids = buffer[self._ids_at : self._ids_at + m].view(num_rows, num_cols)
        values = buffer[self._values_at :].view(torch.float32)[:m].view(num_rows, num_cols)
        return ids, values

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)


@dataclass
class PendingSample:
    """A step whose input prep, forward and logits are enqueued but whose sampling is not
    (deferred sampling); ``ModelRunner.execute_sample`` completes it into an AsyncOutput."""

    step: int
    batch: InputBatch | None  # None: the step scheduled nothing
    in_flight: StepInFlight = field(default_factory=StepInFlight)  # its device results so far


class AsyncOutput:
    """Step N's output; :meth:`get` is the one place the host waits for the device."""

    def __init__(
        self,
        batch: InputBatch | None,
        step: int,
        host: HostOutputBuffers | None,
        ready: DeviceEvent | None,
        release: Callable[[DeviceEvent], None] | None = None,
        pool: SampledBufferPool | None = None,
    ) -> None:
        self.batch = batch
        self.step = step
        self._host = host
        self._ready = ready
        # Told the event once it has been waited for (the device timeline takes a lent end event
        # back into its pool: docs/design.md §4.3).
        self._release = release
        self._pool = pool  # takes ``host.sampled_base`` back once read
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def empty(cls, step: int) -> AsyncOutput:
        """The output of a step that scheduled nothing."""
        return cls(None, step, None, None)

    def is_ready(self) -> bool:
        """Non-blocking: has the d2h copy finished?"""
        return self._ready is None or self._ready.query()

    def wait(self) -> None:
        """Wait for the d2h copy event only (callers trace this as ``wait_output``: the one
        place the host waits for the device). Re-raises an error the device work hit, with its
        original traceback. Idempotent."""
        ready = self._ready
        if ready is None:
            return
        ready.synchronize()
        self._ready = None  # done: is_ready() stays True without the event
        if self._release is not None:
            self._release(ready)

    def get(self) -> ModelRunnerOutput:
        """:meth:`wait` if not done yet, then read host memory into the runner output (host
        work, traced as ``read_output``; docs/design.md §5.5)."""
        if self._result is None:
            self.wait()
            self._result = self._build()
            host = self._host
            if self._pool is not None and host is not None and host.sampled_base is not None:
                self._pool.give_back(host.sampled_base)  # read into Python ints: free again
                if host.draft_ids is None:  # nothing left to read (draft_token_ids reads these)
                    self._host = None
        return self._result

    def draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts (proposed this step, verified by the next one) per request that returned
        tokens; empty unless the step copied them (structured + speculative). After :meth:`get`."""
        if self._result is None:
            raise RuntimeError("draft_token_ids() before get()")
        batch, host = self.batch, self._host
        if batch is None or host is None or host.draft_ids is None:
            return {}
        drafts = host.draft_ids.numpy()
        return {
            req_id: [int(t) for t in drafts[b]]
            for b, (req_id, returns) in enumerate(
                zip(batch.req_ids, batch.returns_tokens, strict=True)
            )
            if returns
        }

    def _build(self) -> ModelRunnerOutput:
        batch, host = self.batch, self._host
        if batch is None or host is None:
            return ModelRunnerOutput(step=self.step, req_ids=[], sampled_token_ids=[])
        # One conversion to Python ints for the whole step (not one per token).
        sampled: list[int] = host.sampled.numpy().tolist()
        returns_tokens = batch.returns_tokens
        if batch.num_drafts == 0 and host.num_accepted is None:
            # No speculation: one logits row, so one token, per request; there is nothing to
            # accept and no slicing by accepted counts to do.
            tokens = [[t] if r else [] for t, r in zip(sampled, returns_tokens, strict=True)]
            num_accepted = [0] * batch.num_reqs
        else:
            tokens, num_accepted = _spec_tokens(batch, host, sampled)
        return ModelRunnerOutput(
            step=self.step,
            req_ids=list(batch.req_ids),
            sampled_token_ids=tokens,
            num_accepted=num_accepted,
            logprobs=_logprobs(batch, host, tokens),
        )


# Not marked hot for the sync lint: it reads pinned host buffers after the output event's wait
# (``.numpy()`` / ``.tolist()`` of host memory, no device read).
def _spec_tokens(
    batch: InputBatch, host: HostOutputBuffers, sampled: list[int]
) -> tuple[list[list[int]], list[int]]:
    """Per request: its accepted drafts plus the bonus token (one list slice), and its accepted
    count (0 for a request still prefilling). One pass over the requests whatever ``k``.

    sampled: [num_logits], request ``b``'s rows at ``cu[b] .. cu[b+1]``."""
    per_req = batch.num_logits_per_req
    if host.num_accepted is None:  # no count copied: every row of a request is emitted
        accepted = [n - 1 for n in per_req]
    else:
        accepted = host.num_accepted.numpy().tolist()
    tokens: list[list[int]] = []
    num_accepted: list[int] = []
    start = 0
    for n, a, returns in zip(per_req, accepted, batch.returns_tokens, strict=True):
        if returns:
            tokens.append(sampled[start : start + a + 1])
            num_accepted.append(a)
        else:
            tokens.append([])
            num_accepted.append(0)
        start += n
    return tokens, num_accepted


_PAIR = np.dtype([("id", np.int64), ("logprob", np.float32)])


# Host memory only, like _spec_tokens (not marked hot for the sync lint).
def _logprobs(
    batch: InputBatch, host: HostOutputBuffers, tokens: list[list[int]]
) -> list[list[list[tuple[int, float]]]] | None:
    """Per request, per emitted token: ``(token id, logprob)`` of the sampled token and the
    top-k (the batch's largest k; the scheduler keeps each request's own); an empty list for a
    request that asked for none (``host.logprobs_asked``), so a batch where a few requests ask
    builds only theirs. NumPy over the step's rows: one gather of the kept rows and one
    conversion to Python tuples, then one list slice per request."""
    if host.logprob_token_ids is None or host.logprobs is None:
        return None
    b = len(tokens)
    emit = np.fromiter(map(len, tokens), np.int64, b)  # [B] rows each request emitted
    if host.logprobs_asked is not None:
        emit[~host.logprobs_asked] = 0
    cu = np.zeros(b + 1, np.int64)  # request r's logits rows: cu[r] .. cu[r + 1]
    np.cumsum(batch.num_logits_per_req, out=cu[1:])
    ends = np.cumsum(emit)
    # the kept rows, request order: request r's first emit[r] logits rows
    kept = np.repeat(cu[:-1] - (ends - emit), emit) + np.arange(int(ends[-1]) if b else 0)
    pairs = np.empty((kept.shape[0], host.logprobs.shape[1]), _PAIR)  # [kept, k + 1]
    pairs["id"] = host.logprob_token_ids.numpy()[kept]
    pairs["logprob"] = host.logprobs.numpy()[kept]
    # a structured array's tolist(): Python (int, float) tuples, one call for the step
    rows = cast("list[list[tuple[int, float]]]", pairs.tolist())
    return [rows[e - c : e] for e, c in zip(ends.tolist(), emit.tolist(), strict=True)]
