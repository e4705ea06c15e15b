"""bench/step_matched.py: the tracer's added time a step, fitted over runs of one deterministic
workload, against synthetic runs with a planted cost, a heavy-tailed step structure and a host
that drifts, and where the plain per-run comparison of block means is biased."""

from __future__ import annotations

import json
import random

import pytest

from bench._interleaved import Interleaver, StepSample, samples_table, summarize
from bench.step_matched import main

STEPS, BLOCK = 1536, 16


def _run(seed: int, tau: float, invert: bool, control: bool) -> dict:
    """One interleaved run: the same steps in every run (a step's cost drawn from one fixed
    seed: heavy-tailed, requests finishing every 97th step), a host that drifts slowly (an AR(1)
    walk, its own per run) plus noise, ``tau`` µs on the traced steps."""
    steps = random.Random(7)
    base = [800.0 + steps.lognormvariate(5.5, 0.8) for _ in range(STEPS)]
    rng = random.Random(seed)
    inter = Interleaver(engine=None, tracer=None, block_steps=BLOCK, skip_steps=4)
    inter.invert = invert
    drift, samples = 0.0, []
    for i in range(STEPS):
        drift = 0.995 * drift + rng.gauss(0, 12.0)
        block = i // BLOCK
        traced = inter.traced_block(block)
        host = base[i] * (1 + 0.0001 * seed) + drift + rng.gauss(0, 40.0)
        host += tau if traced and not control else 0.0
        samples.append(StepSample(block, traced, i % BLOCK >= 4, host + 1500.0, host, host,
                                  proc_us=host, crit_us=host, num_reqs=64,
                                  finished=8 if i % 97 == 0 else 0))  # fmt: skip
    result = summarize(samples)
    result["samples"] = samples_table(samples)
    return {"interleaved": {"trace": result}, "config": {"control": control}}


def _write(tmp_path, runs: dict[str, dict]) -> list[str]:
    paths = []
    for name, data in runs.items():
        path = tmp_path / f"il_{name}.json"
        path.write_text(json.dumps(data))
        paths.append(str(path))
    return paths


def test_the_fit_recovers_a_planted_cost_and_its_null_covers_zero(tmp_path, capsys) -> None:
    runs = {}
    for r in range(1, 5):
        runs[f"ab_{r}"] = _run(r, 25.0, invert=False, control=False)
        runs[f"ab-i_{r}"] = _run(10 + r, 25.0, invert=True, control=False)
        runs[f"aa_{r}"] = _run(20 + r, 25.0, invert=False, control=True)
    out = main(_write(tmp_path, runs) + ["--boot", "60"])
    tracer, null = out["host_us"]["tracer"], out["host_us"]["null"]
    assert tracer["runs"] == 12 and null["runs"] == 4
    assert abs(tracer["tau"] - 25.0) < 8.0
    assert tracer["ci95"][0] < 25.0 < tracer["ci95"][1]
    assert tracer["ci95"][1] - tracer["ci95"][0] < 40.0
    assert null["ci95"][0] < 0.0 < null["ci95"][1]
    assert "tracer adds" in capsys.readouterr().out
    # For contrast, the per-run comparison on the A/A controls, which traced nothing: the same
    # expensive steps in the same kind of block every run give each the same "difference"
    # (-7.6 to -24 µs with this step structure), which the fit's null does not show.
    control_means = [runs[f"aa_{r}"]["interleaved"]["trace"]["host_us"]["mean_diff_median"]
                     for r in range(1, 5)]  # fmt: skip
    assert all(m < -5.0 for m in control_means), control_means


def test_runs_of_different_workloads_or_all_traced_alike_are_refused(tmp_path) -> None:
    one = _run(1, 25.0, invert=False, control=False)
    other = _run(2, 25.0, invert=False, control=False)
    other["interleaved"]["trace"]["samples"]["finished"][100] = 3  # another step structure
    with pytest.raises(ValueError, match="not one deterministic workload"):
        main(_write(tmp_path, {"a_1": one, "b_1": other}))
    same = {"a_1": one, "a_2": _run(3, 25.0, invert=False, control=False)}
    with pytest.raises(ValueError, match="every run traced the same steps"):
        main(_write(tmp_path, same) + ["--boot", "5"])
    with pytest.raises(SystemExit, match="no run with saved samples"):
        del one["interleaved"]["trace"]["samples"]
        main(_write(tmp_path, {"c_1": one}))


def test_a_seeded_order_is_reproducible_and_each_pair_holds_one_traced_block() -> None:
    def order(seed: int | None, invert: bool = False, n: int = 400) -> list[bool]:
        inter = Interleaver(engine=None, tracer=None, block_steps=16, skip_steps=4)
        inter.order_seed, inter.invert = seed, invert
        return [inter.traced_block(b) for b in range(n)]

    seeded = order(5)
    assert seeded == order(5) and seeded != order(6)
    assert all(seeded[2 * p] != seeded[2 * p + 1] for p in range(200))
    firsts = [seeded[2 * p] for p in range(200)]
    assert 60 < sum(firsts) < 140  # random, not alternating
    assert firsts != [p % 2 == 0 for p in range(200)]
    assert order(5, invert=True) == [not t for t in seeded]
    assert order(None)[:8] == [True, False, False, True, True, False, False, True]
    # the order drawn so far is kept as later pairs are drawn
    inter = Interleaver(engine=None, tracer=None, block_steps=16, skip_steps=4, order_seed=9)
    early = [inter.traced_block(b) for b in range(10)]
    inter.traced_block(1000)
    assert [inter.traced_block(b) for b in range(10)] == early
