"""bench/bench_e2e.py: its summary against numbers computed here, and its CPU smoke run end to
end (the sample model: engine async on/off and HF generate, JSON written)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.bench_e2e import QUICK, Variant, main, summarise


def _runs(tok_s: list[float], digest: str = "d") -> list[dict]:
    return [
        {"tok_s": t, "ttft_ms_p50": 10.0 * i, "tpot_ms_p50": float(i), "digest": digest}
        for i, t in enumerate(tok_s, 1)
    ]


def test_summary_ratios_medians_and_token_agreement() -> None:
    hf = Variant("hf generate", None, runs=_runs([100.0, 300.0, 200.0]))
    on = Variant("default async on", ("--async", "on"), runs=_runs([2000.0, 2600.0, 2400.0]))
    off = Variant("default async off", ("--async", "off"), runs=_runs([1000.0, 1500.0, 900.0]))
    off.runs[1]["digest"] = "other"  # one round where async off emitted different tokens
    out = summarise(QUICK, [hf, on, off])
    v = out["variants"]
    assert v["default async on"]["tok_s_median"] == 2400.0
    assert v["default async on"]["ratio_to_hf"] == pytest.approx(2400.0 / 200.0)
    assert v["default async off"]["ratio_to_hf"] == pytest.approx(1000.0 / 200.0)
    assert v["default async off"]["tok_s_min"] == 900.0
    assert v["hf generate"]["ttft_ms_p50"] == statistics.median([10.0, 20.0, 30.0])
    assert out["async_on_off_same_tokens"] == {"default": False}


@pytest.mark.slow  # ~15 s of CPU: three model builds (HF, engine async on, off) and their runs
def test_quick_smoke_run_writes_every_variant(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "e2e.json"
    threads = torch.get_num_threads()
    try:
        main(["--quick", "--rounds", "1", "--out", str(path)])
    finally:  # --quick runs torch on one thread: the tests after this one must not
        torch.set_num_threads(threads)
    doc = json.loads(path.read_text())
    res = doc["results"][QUICK.name]
    assert set(res["variants"]) == {"hf generate", "default async on", "default async off"}
    for name, v in res["variants"].items():
        (run,) = v["runs"]
        # every request got its full output (the bench raises otherwise): tokens add up
        assert run["output_tokens"] % (QUICK.out_len) == 0 and run["output_tokens"] > 0, name
        assert run["tok_s"] == pytest.approx(run["output_tokens"] / run["elapsed_s"])
        assert v["warmup"][0]["build_s"] > 0
    # fp32 on the CPU, greedy: async scheduling changes no token
    assert res["async_on_off_same_tokens"] == {"default": True}


def test_decode_launch_ab_variant_patches_the_kernel_launch_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import bench_e2e
    from engine.kernels import attention

    args = bench_e2e.parse_args(["--no-hf", "--no-async-off", "--decode-launch-ab", "32:4:2"])
    variants = bench_e2e.variants_of(args, QUICK)
    assert [v.name for v in variants] == ["default async on", "default on dec32/4/2"]
    ab = variants[1]
    assert ab.engine_flags == ("--async", "on")
    assert ab.decode_launch == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "head_major": True}
    seen = []

    def fake_run(*_a: object) -> None:
        seen.append(attention.DECODE_LAUNCH)
        raise RuntimeError("run failed")

    monkeypatch.setattr(bench_e2e, "_engine_run", fake_run)
    before = attention.DECODE_LAUNCH
    with pytest.raises(RuntimeError, match="run failed"):
        bench_e2e.engine_run(args, QUICK, ab, 0, 1)
    assert seen == [ab.decode_launch]  # the engine was built and run under the A/B launch
    assert attention.DECODE_LAUNCH is before  # and the default is back after a failure


@pytest.mark.parametrize("spec", ["32:4", "32:x:2", "0:4:2"])
def test_decode_launch_ab_rejects_bad_specs(spec: str) -> None:
    from bench import bench_e2e

    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--decode-launch-ab", spec])
