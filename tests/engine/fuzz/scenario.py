"""Seeded random scenarios for the real engine (tiny model, CPU device): what runs, and when.

``make_scenario(seed)`` draws, from ``random.Random(seed)`` alone, an engine shape (block size, a
KV pool from tight to roomy, token budget, chunked prefill, prefix caching, speculation) and a
handful of requests: prompts that share prefixes (prefix-cache hits) or repeat themselves (n-gram
drafts), greedy / seeded / unseeded sampling, stop tokens, stop strings, ``min_tokens``,
structured outputs (valid and invalid) and aborts at an iteration or at a request state (queued,
prefilling, decoding, with drafts in flight). The same seed always gives the same scenario.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from tests.engine.fuzz.world import DRAFTS, HAS_XGRAMMAR, World

__all__ = ["AbortRule", "RequestSpec", "Scenario", "make_scenario", "ABORT_KINDS"]

MAX_MODEL_LEN = 40
# When an abort fires: at iteration ``at`` / while queued / mid-prefill / once ``at`` tokens are
# committed / while a step with drafts for it is in flight.
ABORT_KINDS = ("iteration", "queued", "prefilling", "decoding", "verifying")
STRUCTURED = (
    {"choice": ["yes", "no", "maybe"]},
    {"regex": r"[a-z]{3}-\d{2}"},
    {"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
)
INVALID_STRUCTURED = ({"regex": "(unclosed"}, {"json_schema": {"type": "no-such-type"}})


@dataclass(frozen=True)
class AbortRule:
    kind: str  # one of ABORT_KINDS
    at: int = 0  # the iteration ("iteration") or the committed-token count ("decoding")


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int  # the engine iteration it is added at
    abort: AbortRule | None = None
    structured: dict | None = None
    invalid: bool = False  # its structured spec must be refused at add time

    @property
    def kind(self) -> str:
        """``greedy``, ``seeded`` (reproducible) or ``unseeded``."""
        if self.params.temperature == 0.0:
            return "greedy"
        return "seeded" if self.params.seed is not None else "unseeded"


@dataclass(frozen=True)
class Scenario:
    seed: int
    engine: dict  # EngineConfig fields (model excluded)
    requests: tuple[RequestSpec, ...]
    async_on: bool  # the batch queue (step_with_batch_queue) or the synchronous step()

    @property
    def spec_method(self) -> str | None:
        return self.engine.get("spec_method")

    def describe(self) -> str:
        e = self.engine
        spec = f"{e.get('spec_method')}x{e.get('num_spec_tokens')}" if e.get("spec_method") else "-"
        return (
            f"seed={self.seed} blocks={e['num_kv_blocks']}x{e['block_size']} "
            f"budget={e['max_num_batched_tokens']} chunked={e['enable_chunked_prefill']} "
            f"prefix={e['enable_prefix_caching']} seqs={e['max_num_seqs']} spec={spec} "
            f"reqs={len(self.requests)} async={self.async_on}"
        )


def make_scenario(seed: int, world: World) -> Scenario:
    rng = random.Random(seed)
    engine = _engine_shape(rng)
    requests = _requests(rng, world, engine)
    return Scenario(seed, engine, tuple(requests), async_on=rng.random() < 0.5)


def _engine_shape(rng: random.Random) -> dict:
    block_size = rng.choice([2, 4, 8])
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    # Tight (a single max-length request fills the pool: preemption) to roomy.
    num_blocks = rng.choice(
        [min_blocks, min_blocks, min_blocks + rng.randint(1, 4), 3 * min_blocks]
    )
    spec_method = rng.choice([None, None, "ngram", "draft"])
    num_spec = rng.randint(1, 4) if spec_method else 0
    chunked = rng.random() < 0.8
    budget = rng.randint(1 + num_spec, 24) if chunked else MAX_MODEL_LEN + rng.randint(0, 16)
    engine = {
        "block_size": block_size,
        "num_kv_blocks": num_blocks,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": rng.randint(1, 5),
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked,
        "enable_prefix_caching": rng.random() < 0.7,
        "spec_method": spec_method,
        "num_spec_tokens": num_spec,
        "spec_model": rng.choice(DRAFTS) if spec_method == "draft" else None,
    }
    return engine


def _prompt(
    rng: random.Random, vocab: int, shared: list[int], earlier: list[tuple[int, ...]]
) -> tuple[int, ...]:
    draw = rng.random()
    if earlier and draw < 0.08:  # the same prompt again: every full block is a cache hit
        return rng.choice(earlier)
    if draw < 0.12:  # room for a token or two only: the whole pool, or max_model_len, binds
        return tuple(
            rng.randrange(1, vocab)
            for _ in range(rng.randint(MAX_MODEL_LEN - 3, MAX_MODEL_LEN - 1))
        )
    length = rng.randint(1, 16)
    if rng.random() < 0.3:  # a repeating pattern: the n-gram proposer finds matches
        period = rng.randint(1, 4)
        pattern = [rng.randrange(1, vocab) for _ in range(period)]
        body = [pattern[i % period] for i in range(length)]
    else:
        body = [rng.randrange(1, vocab) for _ in range(length)]
    if shared and rng.random() < 0.6:
        body = shared[: rng.randint(1, len(shared))] + body
    return tuple(body[: MAX_MODEL_LEN - 2])


def _params(rng: random.Random, world: World, max_tokens: int) -> SamplingParams:
    draw = rng.random()
    if draw < 0.55:
        sampling: dict = {"temperature": 0.0}
    else:
        sampling = {
            "temperature": rng.choice([0.5, 1.0, 1.5]),
            "top_k": rng.choice([0, 0, 5, 40]),
            "top_p": rng.choice([1.0, 1.0, 0.9]),
            "seed": rng.randrange(2**31) if draw < 0.92 else None,
        }
    extra: dict = {}
    if rng.random() < 0.3:
        extra["ignore_eos"] = True
    if rng.random() < 0.2:
        extra["stop_token_ids"] = tuple(rng.randrange(1, world.vocab_size) for _ in range(3))
    if rng.random() < 0.2:
        extra["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.1:
        extra["stop"] = (rng.choice(["e", "a", "o", " "]),)
    if rng.random() < 0.15:  # penalties read the output history, drafts included at verify
        extra["repetition_penalty"] = rng.choice([0.8, 1.3])
        extra["presence_penalty"] = rng.choice([0.0, 0.5])
        extra["frequency_penalty"] = rng.choice([0.0, -0.5, 1.0])
    if rng.random() < 0.1:
        extra["logprobs"] = rng.randint(0, 3)
    return SamplingParams(max_tokens=max_tokens, **sampling, **extra)


def _abort(rng: random.Random) -> AbortRule | None:
    if rng.random() >= 0.3:
        return None
    kind = rng.choice(ABORT_KINDS)
    at = rng.randint(0, 24) if kind == "iteration" else rng.randint(1, 8)
    return AbortRule(kind, at)


def _requests(rng: random.Random, world: World, engine: dict) -> list[RequestSpec]:
    vocab = world.vocab_size
    shared = [rng.randrange(1, vocab) for _ in range(rng.randint(0, 16))]
    out = []
    for index in range(rng.randint(1, 5)):
        prompt = _prompt(rng, vocab, shared, [r.prompt for r in out])
        max_tokens = rng.randint(1, 12)  # may pass max_model_len: capped there
        params = _params(rng, world, max_tokens)
        structured, invalid = None, False
        if HAS_XGRAMMAR and rng.random() < 0.12:
            invalid = rng.random() < 0.25
            structured = rng.choice(INVALID_STRUCTURED if invalid else STRUCTURED)
        arrival = 0 if rng.random() < 0.4 else rng.randint(0, 12)
        out.append(
            RequestSpec(f"r{index}", prompt, params, arrival, _abort(rng), structured, invalid)
        )
    return out
