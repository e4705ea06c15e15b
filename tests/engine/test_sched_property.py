"""Property tests: random workloads (arrivals, prompt sharing, EOS, drafts accepted or not, tight
KV pools that force preemption, aborts) keep every invariant after every call, and the sync
loop and the async batch-queue loops (depth 2, and 3 to reach more interleavings) commit
identical tokens."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.request import Request
from engine.scheduler.async_scheduler import AsyncScheduler
from engine.scheduler.scheduler import Scheduler
from tests.engine.test_sched_harness import (
    FakeDevice,
    RunResult,
    SchedulerParts,
    assert_drained,
    make_request,
    prompt_tokens,
    run_engine,
)

MAX_MODEL_LEN = 40


@dataclass(frozen=True)
class _Spec:
    prompt_len: int
    max_tokens: int
    eos_at: int | None
    arrival: int
    shared: bool
    abort_at: int | None


@dataclass(frozen=True)
class _Workload:
    config: SchedulerParts
    specs: tuple[_Spec, ...]
    shared_prefix: tuple[int, ...]
    draft_salt: int

    def arrivals(self) -> dict[int, list[Request]]:
        out: dict[int, list[Request]] = {}
        for index, spec in enumerate(self.specs):
            prefix = list(self.shared_prefix) if spec.shared else None
            request = make_request(
                f"r{index}", spec.prompt_len, spec.max_tokens, float(index), prefix
            )
            out.setdefault(spec.arrival, []).append(request)
        return out

    def aborts(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for index, spec in enumerate(self.specs):
            if spec.abort_at is not None:
                out.setdefault(spec.abort_at, []).append(f"r{index}")
        return out

    def run(self, depth: int, with_aborts: bool) -> tuple[RunResult, Scheduler]:
        scheduler = (
            self.config.build(AsyncScheduler, max_steps_in_flight=depth)
            if depth > 1
            else self.config.build()
        )
        eos_at = {f"r{i}": s.eos_at for i, s in enumerate(self.specs) if s.eos_at is not None}
        device = FakeDevice(
            self.config.cache.block_size,
            self.config.num_spec_tokens,
            eos_at,
            sync=depth == 1,
            draft_salt=self.draft_salt,
        )
        aborts = self.aborts() if with_aborts else None
        result = run_engine(scheduler, device, self.arrivals(), aborts, depth=depth)
        assert_drained(scheduler)
        for index, spec in enumerate(self.specs):
            # Placeholders count against max_tokens: no token is ever sampled beyond it, not
            # even by a step in flight when EOS arrived.
            assert device.num_sampled.get(f"r{index}", 0) <= spec.max_tokens
        return result, scheduler


@st.composite
def _workloads(draw: st.DrawFn) -> _Workload:
    block_size = draw(st.sampled_from([2, 4]))
    num_spec_tokens = draw(st.integers(0, 3))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 + num_spec_tokens, 48))
    config = SchedulerParts.of(
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=draw(st.integers(MAX_MODEL_LEN // block_size, 48)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget if chunked else max(budget, MAX_MODEL_LEN),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])) if chunked else 0,
        num_spec_tokens=num_spec_tokens,
        debug_invariants=True,  # every schedule / update checks all invariants
    )
    shared_len = draw(st.integers(0, 14))
    spec = st.builds(
        _Spec,
        prompt_len=st.integers(max(shared_len, 1), 30),
        max_tokens=st.integers(1, 14),
        eos_at=st.none() | st.integers(0, 12),
        arrival=st.integers(0, 10),
        shared=st.booleans(),
        abort_at=st.none() | st.integers(0, 25),
    )
    specs = tuple(draw(st.lists(spec, min_size=1, max_size=6)))
    return _Workload(
        config, specs, tuple(prompt_tokens("shared", shared_len)), draw(st.integers(0, 9))
    )


_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(_workloads())
def test_sync_and_async_commit_identical_tokens(workload: _Workload) -> None:
    sync, _ = workload.run(depth=1, with_aborts=False)
    for depth in (2, 3):
        async_, _ = workload.run(depth=depth, with_aborts=False)
        assert async_.tokens == sync.tokens
        assert async_.finish_reasons == sync.finish_reasons
    for index, spec in enumerate(workload.specs):
        tokens = sync.tokens[f"r{index}"]
        assert 1 <= len(tokens) <= spec.max_tokens
        assert spec.prompt_len + len(tokens) <= MAX_MODEL_LEN


@_SETTINGS
@given(_workloads())
def test_aborts_keep_invariants_and_output_prefixes(workload: _Workload) -> None:
    reference, _ = workload.run(depth=1, with_aborts=False)
    for depth in (1, 2):
        result, _ = workload.run(depth=depth, with_aborts=True)
        for req_id, tokens in result.tokens.items():
            assert tokens == reference.tokens[req_id][: len(tokens)]
            assert req_id in result.finish_reasons
