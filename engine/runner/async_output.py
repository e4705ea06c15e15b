"""The handle ``execute_model`` returns: device results still in flight to host memory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


class SampledBufferPool:
    """Host buffers for the sampled tokens, reused once a step's output has been read.

    A buffer holds ``capacity`` int64 (pinned on CUDA); a step takes a view of its first
    ``num_logits`` entries and :meth:`AsyncOutput.get` gives the buffer back after converting
    it to Python ints, so steady steps allocate no host memory (and on CUDA skip the pinned
    allocator's per-allocation event bookkeeping). A buffer never given back (an output nobody
    read) is simply left to the garbage collector; an empty pool allocates a new one.
    """

    def __init__(self, host_empty: Callable[..., torch.Tensor], capacity: int) -> None:
        self._host_empty = host_empty
        self.capacity = capacity
        self._free: list[torch.Tensor] = []
        self.num_allocated = 0

    def take(self) -> torch.Tensor:
        """A free buffer: ``[capacity]`` int64."""
        if self._free:
            return self._free.pop()
        self.num_allocated += 1
        return self._host_empty((self.capacity,), torch.int64)

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

    def get(self) -> ModelRunnerOutput:
        """Wait for the d2h copy event, then read host memory (callers trace this as
        ``wait_output``). Re-raises an error the device work hit, with its original traceback."""
        if self._result is None:
            ready = self._ready
            if ready is not None:
                ready.synchronize()
            self._result = self._build()
            host = self._host
            if self._pool is not None and host is not None and host.sampled_base is not None:
                self._pool.give_back(host.sampled_base)  # read into Python ints: free again
                if host.draft_ids is None:  # nothing left to read (draft_token_ids reads these)
                    self._host = None
            if ready is not None:
                self._ready = None  # done: is_ready() stays True without the event
                if self._release is not None:
                    self._release(ready)
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
            tokens, accepted = self._spec_tokens(batch, host, sampled)
            num_accepted = [a if r else 0 for a, r in zip(accepted, returns_tokens, strict=True)]
        return ModelRunnerOutput(
            step=self.step,
            req_ids=list(batch.req_ids),
            sampled_token_ids=tokens,
            num_accepted=num_accepted,
            logprobs=self._logprobs(batch, host, tokens),
        )

    @staticmethod
    def _spec_tokens(
        batch: InputBatch, host: HostOutputBuffers, sampled: list[int]
    ) -> tuple[list[list[int]], list[int]]:
        """Per request: its accepted drafts plus the bonus token, and the accepted count."""
        accepted = [n - 1 for n in batch.num_logits_per_req]
        if host.num_accepted is not None:
            accepted = host.num_accepted.numpy().tolist()
        tokens: list[list[int]] = []
        start = 0
        for n, a, returns in zip(
            batch.num_logits_per_req, accepted, batch.returns_tokens, strict=True
        ):
            tokens.append(sampled[start : start + a + 1] if returns else [])
            start += n
        return tokens, accepted

    @staticmethod
    def _logprobs(
        batch: InputBatch, host: HostOutputBuffers, tokens: list[list[int]]
    ) -> list[list[list[tuple[int, float]]]] | None:
        if host.logprob_token_ids is None or host.logprobs is None:
            return None
        ids, values = host.logprob_token_ids.numpy(), host.logprobs.numpy()
        out: list[list[list[tuple[int, float]]]] = []
        start = 0
        for n, emitted in zip(batch.num_logits_per_req, tokens, strict=True):
            rows = range(start, start + len(emitted))
            out.append(
                [[(int(i), float(v)) for i, v in zip(ids[r], values[r], strict=True)] for r in rows]
            )
            start += n
        return out
