"""One seed end to end: run its scenario (async on or off, as the seed says), compare with a
reference.

The reference is the same requests on a roomy synchronous engine without speculation, chunking
limits, prefix caching or aborts. Per request:

* every run: at most ``max_tokens`` tokens, a finish reason that fits the last token (EOS or a
  stop token for ``stop`` unless a stop string matched, the cap for ``length``), no EOS/stop token
  before the end once ``min_tokens`` are out, ``abort`` exactly for the requests the scenario
  aborted, ``error`` exactly for the invalid structured ones; a structured request that ended
  with EOS (its grammar complete, not a stop token or string) matches its choice / regex;
* greedy (structured or not): identical to the reference -- aborted: a prefix of it;
* seeded sampling without speculation: identical to the reference. With speculation it is not
  compared: the token at a position depends on whether it was verified as a draft (accept noise,
  recovered token) or sampled plainly, and async scheduling verifies fewer drafts near
  ``max_tokens`` (in-flight placeholders count against the room), so async on and off may
  legitimately differ -- each output is still distributed as the target's;
* unseeded sampling: only the rules of every run.

A failure raises :class:`ScenarioFailure` whose message starts with the one-line replay command.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from tests.engine.fuzz.runner import RunResult, ScenarioFailure, run_scenario
from tests.engine.fuzz.scenario import MAX_MODEL_LEN, RequestSpec, Scenario, make_scenario
from tests.engine.fuzz.world import World, world

__all__ = ["check_seed", "replay_command", "Coverage"]


def replay_command(seed: int, threaded: bool = False) -> str:
    flag = " --threaded" if threaded else ""
    return f"PYTHONPATH=. python -m tests.engine.fuzz --seed {seed}{flag}"


@dataclass
class Coverage:
    """What the scenarios reached, summed over seeds (the suite asserts each part is reached)."""

    scenarios: int = 0
    runs: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    abort_states: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    spec_methods: Counter[str] = field(default_factory=Counter)

    def add(self, scenario: Scenario, runs: list[RunResult]) -> None:
        self.scenarios += 1
        self.spec_methods[str(scenario.engine.get("spec_model") or scenario.spec_method)] += 1
        for run in runs:
            self.runs += 1
            self.preemptions += run.num_preemptions
            self.prefix_hit_tokens += run.num_prefix_hit_tokens
            self.drafts += run.num_drafts
            self.accepted += run.num_accepted
            self.abort_states.update(run.abort_states)
            self.events.update(run.events)
            self.finish_reasons.update(r or "none" for r in run.finish_reasons.values())

    def summary(self) -> str:
        rate = self.accepted / self.drafts if self.drafts else 0.0
        return (
            f"{self.scenarios} scenarios, {self.runs} engine runs; preemptions {self.preemptions}, "
            f"prefix-hit tokens {self.prefix_hit_tokens}, drafts {self.drafts} "
            f"(accepted {rate:.0%}); aborts by state {dict(self.abort_states)}; "
            f"finish reasons {dict(self.finish_reasons)}; spec {dict(self.spec_methods)}; "
            f"events {dict(self.events)}"
        )


def check_seed(seed: int, coverage: Coverage | None = None, threaded: bool = False) -> None:
    """Run and check one seed; raises :class:`ScenarioFailure` (replay command first).
    ``threaded``: the engine runs on the worker-thread CPU device (timing varies, so a failure
    may need a few replays)."""
    w = world()
    scenario = make_scenario(seed, w)
    try:
        runs = [run_scenario(scenario, w, async_on=scenario.async_on, threaded=threaded)]
        ref = run_scenario(scenario, w, async_on=False, reference=True)
        for run in [*runs, ref]:
            _check_run(scenario, run, w)
        _compare(scenario, runs, ref)
    except Exception as err:
        raise ScenarioFailure(
            f"replay: {replay_command(seed, threaded)}\n  {scenario.describe()}\n  "
            f"{type(err).__name__}: {err}"
        ) from err
    if coverage is not None:
        coverage.add(scenario, [*runs, ref])


def _check_run(scenario: Scenario, run: RunResult, w: World) -> None:
    for spec in scenario.requests:
        tokens, reason = run.tokens[spec.req_id], run.finish_reasons[spec.req_id]
        where = f"[{run.label}] {spec.req_id}"
        if spec.invalid:
            if reason != "error" or tokens:
                raise ScenarioFailure(f"{where}: invalid structured ended {reason} with {tokens}")
            continue
        if (reason == "abort") != (spec.req_id in run.aborted):
            raise ScenarioFailure(f"{where}: finish {reason}, aborted={spec.req_id in run.aborted}")
        _check_tokens(spec, tokens, reason, w, where)
        expected_logprobs = len(tokens) if spec.params.logprobs is not None else 0
        if run.num_logprobs[spec.req_id] != expected_logprobs:
            raise ScenarioFailure(
                f"{where}: {run.num_logprobs[spec.req_id]} logprob entries for {len(tokens)} tokens"
            )


def _check_tokens(
    spec: RequestSpec, tokens: list[int], reason: str | None, w: World, where: str
) -> None:
    params = spec.params
    if len(tokens) > params.max_tokens:
        raise ScenarioFailure(f"{where}: {len(tokens)} tokens > max_tokens {params.max_tokens}")
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {w.eos})
    for index, token in enumerate(tokens[:-1]):
        if token in stops and index + 1 >= params.min_tokens:
            raise ScenarioFailure(f"{where}: stop token {token} at {index} not last: {tokens}")
    full = len(tokens) == params.max_tokens or len(spec.prompt) + len(tokens) >= MAX_MODEL_LEN
    if reason == "length" and not full:
        raise ScenarioFailure(f"{where}: 'length' after {len(tokens)} tokens")
    if reason == "stop":
        text_stop = bool(params.stop) and any(s in w.tokenizer.decode(tokens) for s in params.stop)
        if not (tokens and tokens[-1] in stops) and not text_stop:
            raise ScenarioFailure(f"{where}: 'stop' but last token {tokens[-1:]} stops nothing")
        if len(tokens) < params.min_tokens:
            raise ScenarioFailure(f"{where}: stopped before min_tokens {params.min_tokens}")
        if spec.structured is not None and tokens[-1] == w.eos:  # the grammar completed
            _check_structured(spec, tokens, w, where)


def _check_structured(spec: RequestSpec, tokens: list[int], w: World, where: str) -> None:
    text = w.tokenizer.decode([t for t in tokens if t != w.eos])
    structured = spec.structured or {}
    if "choice" in structured and text not in structured["choice"]:
        raise ScenarioFailure(f"{where}: {text!r} is not one of {structured['choice']}")
    if "regex" in structured and re.fullmatch(structured["regex"], text) is None:
        raise ScenarioFailure(f"{where}: {text!r} does not match {structured['regex']!r}")


def _compare(scenario: Scenario, runs: list[RunResult], ref: RunResult) -> None:
    speculative = scenario.spec_method is not None
    for spec in scenario.requests:
        if spec.invalid or spec.kind == "unseeded" or (spec.kind == "seeded" and speculative):
            continue
        rid = spec.req_id
        expected, against = ref.tokens[rid], ref.label
        expected_reason = ref.finish_reasons[rid]
        for run in runs:
            if run.label == against:
                continue
            got = run.tokens[rid]
            if rid in run.aborted:
                if got != expected[: len(got)]:
                    raise ScenarioFailure(
                        f"[{run.label}] {rid} ({spec.kind}, aborted): {got} is not a prefix of "
                        f"{against}'s {expected}"
                    )
            elif got != expected or run.finish_reasons[rid] != expected_reason:
                raise ScenarioFailure(
                    f"[{run.label}] {rid} ({spec.kind}): {got} ({run.finish_reasons[rid]}) != "
                    f"{against}'s {expected} ({expected_reason})"
                )
