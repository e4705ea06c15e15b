"""Warm-up before the workload (docs/design.md §2.14): dummy steps through the model runner.

A Triton kernel is compiled per specialization: its ``tl.constexpr`` block sizes (which follow the
step's longest query: input prep's ``BLOCK``, attention's ``BLOCK_M``) and, for every integer
argument, whether it is 1 or divisible by 16, and for every pointer whether it is 16-byte aligned
(the step's packed inputs are slices whose alignment follows the request count). A run reaches a
new specialization whenever a step has a new such shape, and pays the JIT compile inside the
measured workload. So the engine, once built, runs :func:`warmup_plan`'s steps: uniform decode
batches at request counts ``{1, 2, 3}`` and every power of two up to ``max_num_seqs`` (CUDA graph
sizes are captured already; this adds the eager input prep and sampling around them), mixed
steps at every query-length bucket ``{2, 9, 16, 32, ..., max}`` for request counts ``{1, 2, 3, 4,
16, max}`` (each residue class of the specializations above), every sampling variant (greedy,
temperature, top-k/top-p/min-p, penalties, logprobs), a grammar bitmask (also split as deferred
sampling does), and with a proposer the verify and draft paths.

The dummy requests never reach the scheduler: the runner sees :class:`SchedulerOutput` records
built here, with seeded sampling (an unseeded request would advance the engine's seed counter), and
each step's requests are freed by the next. Warm-up runs before the first real request exists, so
the KV blocks it writes hold no one's data; the scheduler's block pool, prefix cache, request books
and step counter are untouched. The tracer is muted meanwhile: no warm-up step is in the trace.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import CacheConfig, EngineConfig, ResolvedFeatures, SchedulerConfig
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from instrument.tracer import Tracer

__all__ = [
    "WarmupReport",
    "WarmupStep",
    "blocks_for",
    "max_query_len",
    "profile_plan",
    "run_steps",
    "warm_up",
    "warmup_plan",
]

_log = logging.getLogger("stepscope.engine")

GREEDY = SamplingParams(temperature=0.0, seed=0)
RANDOM = SamplingParams(temperature=0.8, seed=0)
FILTERED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=0)
PENALISED = SamplingParams(
    temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5, seed=0
)
LOGPROBS = SamplingParams(temperature=0.0, logprobs=5, seed=0)
# The most memory a step's sampling can take: every filter, penalties and the most logprobs.
HEAVIEST = SamplingParams(
    temperature=1.0,
    top_p=0.9,
    top_k=50,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    logprobs=MAX_LOGPROBS,
    seed=0,
)
SAMPLING_VARIANTS = (RANDOM, FILTERED, PENALISED, LOGPROBS)
# Request counts of mixed steps: 1 (integer args specialise on 1), 2 and 3 (packed slices not
# 16-byte aligned), 4 (aligned, not divisible by 16), 16 (divisible by 16).
_MIXED_REQUEST_COUNTS = (1, 2, 3, 4, 16)


@dataclass(frozen=True)
class WarmupStep:
    """One dummy step: fresh requests with these query lengths (prompt = query, so each
    samples), all with ``params``. ``bitmask``: an all-allowed grammar mask; ``deferred``: enqueued
    as forward then sample (deferred sampling); ``verify``: then one more step verifying
    ``num_spec_tokens`` drafts per request (needs a proposer)."""

    query_lens: tuple[int, ...]
    params: SamplingParams = GREEDY
    bitmask: bool = False
    deferred: bool = False
    verify: bool = False

    @property
    def num_steps(self) -> int:
        return 2 if self.verify else 1


def max_query_len(limits: SchedulerConfig, cache: CacheConfig, num_spec_tokens: int = 0) -> int:
    """Longest dummy prompt under the engine's resolved scheduler part (``limits``) and cache
    part: its sampled token, ``num_spec_tokens`` drafts and their verify (the slots
    :func:`blocks_for` reserves) fit the model length, hence the block table's row, and the KV
    blocks every request of the step shares."""
    k = num_spec_tokens
    return max(
        1,
        min(
            limits.max_num_batched_tokens,
            limits.resolved_max_model_len - 2 - 2 * k,
            cache.resolved_num_kv_blocks * cache.block_size - 2 - 2 * k,
        ),
    )


def blocks_for(cache: CacheConfig, query_len: int, num_spec_tokens: int = 0) -> list[int]:
    """Blocks ``0..n-1`` of the resolved pool, shared by the step's requests (their KV is never
    read back)."""
    tokens = query_len + 2 + 2 * num_spec_tokens
    return list(range(min(cache.resolved_num_kv_blocks, cache.blocks_for(tokens))))


@dataclass(frozen=True)
class WarmupReport:
    """What warm-up did: runner steps run and wall seconds (compiles included)."""

    num_steps: int
    seconds: float


def request_counts(max_num_seqs: int) -> list[int]:
    """Uniform decode batch sizes to warm: 1, 2, 3, every power of two, and ``max_num_seqs``."""
    powers = {1 << i for i in range(max_num_seqs.bit_length())}
    return sorted(n for n in powers | {1, 2, 3, max_num_seqs} if n <= max_num_seqs)


def query_buckets(max_query_len: int) -> list[int]:
    """Longest-query buckets: 2 and 9 (attention's small/large ``BLOCK_M`` for GQA groups up to
    8), then powers of two (input prep's ``BLOCK``) and ``max_query_len`` itself."""
    powers = {1 << i for i in range(4, max_query_len.bit_length())}
    return sorted(q for q in powers | {2, 9, max_query_len} if 2 <= q <= max_query_len)


def warmup_plan(
    limits: SchedulerConfig, cache: CacheConfig, num_spec_tokens: int = 0
) -> list[WarmupStep]:
    """Every step shape a run can reach, by the specialization classes of the module docstring,
    within the resolved scheduler part (``limits``) and cache part (:meth:`EngineConfig.resolved`)
    and, with a proposer, ``num_spec_tokens`` drafts per request."""
    seqs, budget = limits.resolved_max_num_seqs, limits.max_num_batched_tokens
    max_q = max_query_len(limits, cache, num_spec_tokens)
    decode_counts = [r for r in request_counts(seqs) if r <= budget]
    plan = [WarmupStep((1,) * r) for r in decode_counts]
    mixed_counts = sorted({r for r in _MIXED_REQUEST_COUNTS if r <= seqs} | {min(seqs, budget)})
    for r in mixed_counts:
        for q in query_buckets(max_q):
            if q + r - 1 <= budget:
                plan.append(WarmupStep((q,) + (1,) * (r - 1)))
    most = decode_counts[-1]
    few_and_most = sorted({r for r in (1, 3) if r <= most} | {most})
    for params in SAMPLING_VARIANTS:
        plan += [WarmupStep((1,) * r, params) for r in few_and_most]
    plan += [WarmupStep((1,) * r, bitmask=True) for r in few_and_most]
    plan += [WarmupStep((min(16, max_q),), bitmask=True, deferred=True)]
    if num_spec_tokens:
        spec_counts = [r for r in mixed_counts if r * (1 + num_spec_tokens) <= budget]
        plan += [WarmupStep((1,) * r, verify=True) for r in spec_counts]
        plan += [WarmupStep((1,) * r, RANDOM, verify=True) for r in spec_counts[:1]]
    return plan


def profile_plan(
    limits: SchedulerConfig, cache: CacheConfig, num_spec_tokens: int = 0
) -> list[WarmupStep]:
    """The steps with the largest temporaries: ``max_num_batched_tokens`` tokens over as many
    requests as may run (the sampler at ``max_num_seqs`` rows), with the heaviest sampling; with a
    proposer, then a verify of every request's drafts (parts as in :func:`warmup_plan`)."""
    budget = limits.max_num_batched_tokens
    r = min(limits.resolved_max_num_seqs, budget)
    lens = _split_tokens(budget, r, max_query_len(limits, cache, num_spec_tokens))
    verify = num_spec_tokens > 0 and r * (1 + num_spec_tokens) <= budget
    return [WarmupStep(tuple(lens), HEAVIEST, verify=verify)]


def _split_tokens(total: int, num_reqs: int, max_query_len: int) -> list[int]:
    """``num_reqs`` query lengths of at least 1 and at most ``max_query_len``, summing to
    ``total`` where they can, the longest first."""
    lens = [1] * num_reqs
    left = total - num_reqs
    for i in range(num_reqs):
        extra = min(left, max_query_len - 1)
        lens[i] += extra
        left -= extra
    return lens


def run_steps(runner: Any, plan: list[WarmupStep], tracer: Tracer) -> WarmupReport:
    """Run ``plan`` on ``runner`` (a ``ModelRunner``), one synchronous step at a time, with the
    tracer muted; every dummy request is freed at the end. The requests' blocks come from the
    runner's own cache part, its drafts from its spec decoder."""
    start = time.monotonic()
    driver = _DummySteps(runner)
    with tracer.muted(), torch.no_grad():
        for step in plan:
            driver.run(step)
        driver.finish()
    return WarmupReport(driver.num_steps, time.monotonic() - start)


class _DummySteps:
    """Builds the dummy requests' scheduler outputs and makes the runner calls."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.cache: CacheConfig = runner.cache
        self.num_spec_tokens: int = 0 if runner.spec is None else runner.spec.num_spec_tokens
        self.num_steps = 0
        self._live: set[str] = set()  # freed by the next step
        self._next_id = 0

    def run(self, step: WarmupStep) -> None:
        ids = [f"warmup-{self._next_id + i}" for i in range(len(step.query_lens))]
        self._next_id += len(ids)
        new = [
            NewRequestData(
                req_id, [0] * q, [], step.params, blocks_for(self.cache, q, self.num_spec_tokens), 0
            )
            for req_id, q in zip(ids, step.query_lens, strict=True)
        ]
        tokens = dict(zip(ids, step.query_lens, strict=True))
        self._execute(self._output(new, CachedRequestData(), tokens, {}), step)
        if step.verify:
            k = self.num_spec_tokens
            cached = CachedRequestData(ids, [[] for _ in ids], list(step.query_lens))
            drafts = {req_id: [-1] * k for req_id in ids}
            self._execute(self._output([], cached, {req_id: 1 + k for req_id in ids}, drafts), step)
        self._live = set(ids)

    def finish(self) -> None:
        """Free the last step's requests."""
        self.runner.free_requests(self._live)
        self._live = set()

    def _output(
        self,
        new: list[NewRequestData],
        cached: CachedRequestData,
        tokens: dict[str, int],
        drafts: dict[str, list[int]],
    ) -> SchedulerOutput:
        out = SchedulerOutput(
            step=self.num_steps,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=tokens,
            total_num_scheduled_tokens=sum(tokens.values()),
            scheduled_spec_decode_tokens=drafts,
            finished_req_ids=self._live,
        )
        self._live = set()
        return out

    def _execute(self, out: SchedulerOutput, step: WarmupStep) -> None:
        if out.total_num_scheduled_tokens:
            self.num_steps += 1
        num_logits = sum(
            1 + len(out.scheduled_spec_decode_tokens.get(r, ())) for r in out.num_scheduled_tokens
        )
        bitmask = None
        if step.bitmask:  # all tokens allowed: [num_logits, ceil(V / 32)] int32
            words = -(-self.runner.vocab_size // 32)
            bitmask = self.runner.device.host_empty((num_logits, words), torch.int32).fill_(-1)
        if step.deferred:
            pending = self.runner.execute_forward(out)
            handle = self.runner.execute_sample(pending, bitmask)
        else:
            handle = self.runner.execute_model(out, bitmask)
        handle.get()


def warm_up(
    runner: Any, config: EngineConfig, features: ResolvedFeatures, tracer: Tracer
) -> WarmupReport:
    """The engine's warm-up of its freshly built ``runner`` (nothing when the resolved
    ``warmup`` feature is off); ``config`` has what start-up resolved
    (:meth:`EngineConfig.resolved`: ``max_model_len``, the KV pool's blocks), and its scheduler
    and cache parts bound the plan as they bound the runner. Every tensor-parallel rank runs the
    same plan on its own runner (the forward's collectives pair up)."""
    if not features.warmup:
        return WarmupReport(0, 0.0)
    k = config.spec.num_spec_tokens if features.spec_method else 0
    report = run_steps(runner, warmup_plan(config.scheduler, config.cache, k), tracer)
    _log.info("warm-up: %d steps in %.2f s", report.num_steps, report.seconds)
    return report
