"""bench/pool_interleaved.py: interleaved runs pooled over runs, from JSON files and archives."""

from __future__ import annotations

import io
import json
import math
import statistics
import tarfile

import pytest

from bench._interleaved import summarize
from bench.pool_interleaved import load_runs, main, t95
from tests.bench.test_trace_overhead_interleaved import _synthetic


def _write_run(added_us: float, seed_blocks: int) -> dict:
    return {"interleaved": {"trace": summarize(_synthetic(added_us, seed_blocks, 32))}}


def test_runs_are_pooled_per_variant_and_over_all(tmp_path, capsys) -> None:
    runs = {("c", 1): _write_run(30.0, 40), ("c", 2): _write_run(50.0, 40),
            ("c", 3): _write_run(10.0, 40), ("python", 1): _write_run(90.0, 40)}  # fmt: skip
    archive = tmp_path / "core_ab.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for (variant, rnd), data in runs.items():
            if variant == "python":
                continue
            body = json.dumps(data).encode()
            info = tarfile.TarInfo(f"core_ab/il_{variant}_{rnd}.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    single = tmp_path / "il_python_1.json"
    single.write_text(json.dumps(runs[("python", 1)]))
    out = tmp_path / "pool.json"
    result = main([str(archive), str(single), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(r["variant"], r["round"]) for r in result["rows"]] == [
        ("c", 1),
        ("c", 2),
        ("c", 3),
        ("python", 1),
    ]
    # Brute force from the runs' own summaries.
    c_means = [runs[("c", k)]["interleaved"]["trace"]["host_us"]["mean_diff_median"]
               for k in (1, 2, 3)]  # fmt: skip
    c_medians = [runs[("c", k)]["interleaved"]["trace"]["host_us"]["diff_median"]
                 for k in (1, 2, 3)]  # fmt: skip
    pooled = result["pools"]["c"]["host_us"]
    assert result["pools"]["c"]["runs"] == 3
    assert pooled["median_of_paired_medians"] == statistics.median(c_medians)
    assert pooled["median_of_paired_means"] == statistics.median(c_means)
    mean = statistics.fmean(c_means)
    half = 4.303 * statistics.stdev(c_means) / math.sqrt(3)
    assert pooled["mean_of_paired_means"] == pytest.approx(mean)
    assert pooled["mean_ci95"] == pytest.approx([mean - half, mean + half])
    # The planted costs (10, 30, 50 µs) come back within the synthetic noise.
    assert abs(pooled["mean_of_paired_means"] - 30.0) < 8.0
    assert result["pools"]["python"]["host_us"]["mean_ci95"] is None  # one run: no interval
    assert result["pools"]["all"]["runs"] == 4
    printed = capsys.readouterr().out
    assert "variant c: 3 runs" in printed and "all runs: 4 runs" in printed
    assert main([str(archive), str(single), "--variants", "python"])["pools"].keys() == {"python"}


def test_bad_input_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "il_c_1.json"
    bad.write_text(json.dumps({"off": []}))  # a plain bench result, not --interleaved
    with pytest.raises(ValueError, match="not an --interleaved result"):
        load_runs([str(bad)])
    with pytest.raises(ValueError, match="at least 2 samples"):
        t95(0)
    assert t95(12) == 2.179 and t95(100) == 1.960
