"""Test harness for the scheduler: a deterministic fake device and the two engine loops.

``FakeDevice`` plays the runner plus the device. It keeps per-request token state the way the
MRV2 runner does (rows created from ``NewRequestData``, sampled tokens appended on the device,
drafts kept on the device, rows dropped on ``finished_req_ids``) and never reads what the CPU did
not send. Its "model" is a hash of the token history, so a wrong history (a bad resume after
preemption) changes every later token. Its KV store holds, per slot, a hash of the prefix that
produced it, and every step checks the KV it attends to: a block reused too early or a prefix
cache hit on a wrong/unconfirmed block fails the test.

This is a harness for scheduler logic, not a stand-in for the real runner.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import CPU_MAX_NUM_SEQS, CacheConfig, SchedulerConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from engine.scheduler.request_output import RequestOutput
from engine.scheduler.scheduler import Scheduler

VOCAB = 1000
EOS = 2


@dataclass(frozen=True)
class SchedulerParts:
    """What a scheduler is built from: the engine config's scheduler and KV cache parts and the
    lookahead slots, as ``EngineCore`` passes them."""

    limits: SchedulerConfig
    cache: CacheConfig
    num_spec_tokens: int = 0

    @classmethod
    def of(cls, num_spec_tokens: int = 0, **flat: Any) -> SchedulerParts:
        """Parts from flat field names (each to the part that owns it)."""
        cache_names = {f.name for f in fields(CacheConfig)}
        cache = {k: v for k, v in flat.items() if k in cache_names}
        limits = {k: v for k, v in flat.items() if k not in cache_names}
        limits.setdefault("max_num_seqs", CPU_MAX_NUM_SEQS)  # EngineCore resolves it by device
        return cls(SchedulerConfig(**limits), CacheConfig(**cache), num_spec_tokens)

    def build(self, cls: type[Scheduler] = Scheduler, *args: Any, **kw: Any) -> Any:
        """``cls(limits, cache, *args, num_spec_tokens=..., **kw)`` (checks the limits)."""
        return cls(self.limits, self.cache, *args, num_spec_tokens=self.num_spec_tokens, **kw)


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def target_token(req_id: str, history: list[int], num_prompt: int, eos_at: int | None) -> int:
    """The 'model': next token after ``history``; EOS at output index ``eos_at``."""
    if eos_at is not None and len(history) - num_prompt == eos_at:
        return EOS
    token = _h(req_id, len(history), tuple(history[-4:])) % VOCAB
    return token if token != EOS else EOS + 1


def draft_token(
    req_id: str, history: list[int], num_prompt: int, eos_at: int | None, salt: int = 0
) -> int:
    """A drafter right about 2/3 of the time (deterministic in the history and ``salt``)."""
    token = target_token(req_id, history, num_prompt, eos_at)
    if _h("draft", salt, req_id, len(history)) % 3 == 0:
        return (token + 7) % VOCAB
    return token


def prompt_tokens(seed: str, length: int, shared_prefix: list[int] | None = None) -> list[int]:
    prefix = list(shared_prefix or [])
    return prefix + [10 + _h(seed, i) % (VOCAB - 10) for i in range(length - len(prefix))]


def make_request(
    req_id: str,
    prompt_len: int = 8,
    max_tokens: int = 8,
    arrival_time: float = 0.0,
    shared_prefix: list[int] | None = None,
    **params: object,
) -> Request:
    return Request(
        req_id,
        prompt_tokens(req_id, prompt_len, shared_prefix),
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        arrival_time=arrival_time,
        eos_token_id=EOS,
    )


@dataclass
class _Row:
    num_prompt: int
    tokens: list[int]  # prompt + outputs, as the device knows them
    num_computed: int  # device truth (rejected drafts excluded)
    block_ids: list[int]
    prefix_hashes: list[int] = field(default_factory=list)  # per position, of the true tokens
    drafts: list[int] = field(default_factory=list)


class FakeDevice:
    """Executes ``SchedulerOutput``s in order, like a single stream would."""

    def __init__(
        self,
        block_size: int,
        num_spec_tokens: int = 0,
        eos_at: dict[str, int] | None = None,
        sync: bool = True,
        draft_salt: int = 0,
    ) -> None:
        self.block_size = block_size
        self.draft_salt = draft_salt
        self.num_spec_tokens = num_spec_tokens
        self.eos_at = eos_at or {}
        self.sync = sync
        self.rows: dict[str, _Row] = {}
        self.kv: dict[int, int] = {}  # slot -> hash of the prefix whose last token wrote it
        self.steps_per_request: dict[str, int] = {}
        self.num_sampled: dict[str, int] = {}  # tokens the device produced, dropped ones included

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            assert req_id in self.rows, f"finished id {req_id} the runner does not hold"
            del self.rows[req_id]
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, f"{new.req_id} added twice"
            tokens = new.prompt_token_ids + new.output_token_ids
            row = _Row(
                len(new.prompt_token_ids), tokens, new.num_computed_tokens, list(new.block_ids)
            )
            self._extend_prefix_hashes(row, new.req_id)
            self._check_kv(new.req_id, row, new.num_computed_tokens)
            self.rows[new.req_id] = row
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.rows[req_id]
            row.block_ids.extend(new_blocks)
            # The scheduler's frontier is optimistic: never behind the device's truth.
            assert num_computed >= row.num_computed, (req_id, num_computed, row.num_computed)
            if self.sync:
                assert num_computed == row.num_computed, (req_id, num_computed, row.num_computed)
        req_ids, sampled = [], []
        for req_id, num_new in out.num_scheduled_tokens.items():
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            req_ids.append(req_id)
            sampled.append(self._run_request(req_id, num_new, num_drafts))
            self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + len(sampled[-1])
            self.steps_per_request[req_id] = self.steps_per_request.get(req_id, 0) + 1
        num_accepted = [max(0, len(s) - 1) for s in sampled]
        return ModelRunnerOutput(out.step, req_ids, sampled, num_accepted)

    def _run_request(self, req_id: str, num_new: int, num_drafts: int) -> list[int]:
        row = self.rows[req_id]
        assert num_new > 0, f"{req_id}: scheduled with no token (logits need one computed)"
        start = row.num_computed
        num_known = num_new - num_drafts
        assert start + num_known <= len(row.tokens), f"{req_id}: scheduled unknown tokens"
        samples = start + num_known == len(row.tokens)
        assert samples or num_drafts == 0, f"{req_id}: drafts scheduled mid-prefill"
        drafts = row.drafts[:num_drafts]
        assert len(drafts) == num_drafts, f"{req_id}: more drafts scheduled than proposed"
        inputs = row.tokens[start : start + num_known] + drafts
        self._check_kv(req_id, row, start)
        self._write_kv(req_id, row, start, inputs)
        if not samples:
            row.num_computed += num_new
            return []
        eos_at = self.eos_at.get(req_id)
        out: list[int] = []
        for draft in drafts:
            target = target_token(req_id, row.tokens + out, row.num_prompt, eos_at)
            out.append(target)
            if target != draft:
                break
        else:
            out.append(target_token(req_id, row.tokens + out, row.num_prompt, eos_at))
        row.num_computed = start + num_known + len(out) - 1
        row.tokens.extend(out)
        self._extend_prefix_hashes(row, req_id)
        history = list(row.tokens)
        row.drafts = []
        for _ in range(self.num_spec_tokens):
            draft = draft_token(req_id, history, row.num_prompt, eos_at, self.draft_salt)
            row.drafts.append(draft)
            history.append(row.drafts[-1])
        return out

    def _slot(self, row: _Row, req_id: str, position: int) -> int:
        index = position // self.block_size
        assert index < len(row.block_ids), f"{req_id}: position {position} has no block"
        return row.block_ids[index] * self.block_size + position % self.block_size

    def _write_kv(self, req_id: str, row: _Row, start: int, inputs: list[int]) -> None:
        parent = row.prefix_hashes[start - 1] if start else 0
        for offset, token in enumerate(inputs):
            position = start + offset
            block_id = row.block_ids[position // self.block_size]
            for other_id, other in self.rows.items():
                assert other_id == req_id or block_id not in other.block_ids, (
                    f"{req_id} writes block {block_id} that {other_id} also holds"
                )
            parent = _h(parent, token)
            self.kv[self._slot(row, req_id, position)] = parent

    def _check_kv(self, req_id: str, row: _Row, num_positions: int) -> None:
        for position in range(num_positions):
            slot = self._slot(row, req_id, position)
            assert self.kv.get(slot) == row.prefix_hashes[position], (
                f"{req_id}: KV at position {position} (slot {slot}) is not its prefix"
            )

    @staticmethod
    def _extend_prefix_hashes(row: _Row, req_id: str) -> None:
        while len(row.prefix_hashes) < len(row.tokens):
            parent = row.prefix_hashes[-1] if row.prefix_hashes else 0
            row.prefix_hashes.append(_h(parent, row.tokens[len(row.prefix_hashes)]))


@dataclass
class RunResult:
    tokens: dict[str, list[int]]
    finish_reasons: dict[str, str | None]
    num_steps: int
    outputs: list[RequestOutput]


Arrivals = dict[int, list[Request]]
Aborts = dict[int, list[str]]


def run_engine(
    scheduler: Scheduler,
    device: FakeDevice,
    arrivals: Arrivals,
    aborts: Aborts | None = None,
    depth: int = 1,
    max_iterations: int = 10_000,
    on_iteration: Callable[[int], None] | None = None,
) -> RunResult:
    """Drive the scheduler like EngineCore: ``depth == 1`` is ``step()``, 2 is the batch queue.

    Requests in ``arrivals[i]`` are added at the start of iteration ``i`` (before its schedule).
    """
    aborts = aborts or {}
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    result = RunResult({}, {}, 0, [])
    last = max([*arrivals, *aborts, 0])
    for iteration in range(max_iterations):
        for request in arrivals.get(iteration, []):
            scheduler.add_request(request)
            result.tokens[request.req_id] = []
        for req_id in aborts.get(iteration, []):
            final = scheduler.abort_request(req_id)
            if final is not None:
                result.finish_reasons[req_id] = final.finish_reason
        if on_iteration is not None:
            on_iteration(iteration)
        if iteration > last and not scheduler.has_unfinished_requests() and not queue:
            return result
        scheduled = 0
        if len(queue) < depth and scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduled = out.total_num_scheduled_tokens
            if scheduled:
                queue.append((out, device.execute(out)))
                result.num_steps += 1
        if queue and (len(queue) == depth or not scheduled):
            out, runner_out = queue.popleft()
            for output in scheduler.update_from_output(out, runner_out):
                result.outputs.append(output)
                result.tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
                if output.finished:
                    result.finish_reasons[output.req_id] = output.finish_reason
    raise AssertionError("engine did not drain")


def drive(
    scheduler: Scheduler,
    device: FakeDevice,
    arrivals: dict[int, list[Request]],
    depth: int,
    max_iterations: int,
) -> Iterator[tuple[SchedulerOutput, ModelRunnerOutput, Any]]:
    """The engine loop of the columnar-path tests, without :func:`run_engine`'s books: requests
    join at their iteration, up to ``depth`` steps are in flight, and each update is yielded as
    (scheduler output, runner output, what ``update_from_output`` returned) once its step leaves
    the queue. Fails when the scheduler has not drained after ``max_iterations``."""
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    last = max(arrivals)
    for iteration in range(max_iterations):
        for request in arrivals.get(iteration, []):
            scheduler.add_request(request)
        if iteration > last and not scheduler.has_unfinished_requests() and not queue:
            return
        scheduled = 0
        if len(queue) < depth and scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduled = out.total_num_scheduled_tokens
            if scheduled:
                queue.append((out, device.execute(out)))
        if queue and (len(queue) == depth or not scheduled):
            out, runner_out = queue.popleft()
            yield out, runner_out, scheduler.update_from_output(out, runner_out)
    raise AssertionError("did not drain")


def assert_drained(scheduler: Scheduler) -> None:
    """After a run: nothing in flight, no request left, no placeholder, every block free."""
    scheduler.check_invariants()
    stats = scheduler.get_stats()
    assert scheduler.num_steps_in_flight == 0 and scheduler.num_requests == 0
    assert stats.output_placeholders == 0 and stats.running_requests == stats.waiting_requests == 0
    pool = scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks and stats.kv_usage == 0.0


def test_fake_device_is_deterministic_in_history() -> None:
    history = prompt_tokens("a", 5)
    assert target_token("a", history, 5, None) == target_token("a", list(history), 5, None)
    assert target_token("a", history, 5, eos_at=0) == EOS
    assert all(target_token("a", history + [t], 5, None) != EOS for t in range(50))
