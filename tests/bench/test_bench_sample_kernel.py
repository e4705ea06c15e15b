"""bench/bench_sample_kernel.py on the CPU (TRITON_INTERPRET=1): a tiny vocab, every op and
dtype, old and new kernels giving the same tokens, and a sweep that names its best constants."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from bench.bench_sample_kernel import main  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke test")
def test_bench_runs_on_the_cpu_and_old_equals_new(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sample.json"
    argv = ["--device", "cpu", "--vocab", "300", "--batches", "2", "--iters", "1"]
    argv += ["--sweep-batches", "2", "--sweep-chunks", "128", "--json", str(out)]
    result = main(argv)
    cases = {(r["dtype"], r["op"]) for r in result["compare"]}
    assert cases == {(d, op) for d in ("bf16", "fp32") for op in ("greedy", "random", "lse")}
    assert all(r["same"] for r in result["compare"] + result["sweep"])
    assert all(r["ref_rows_differ"] == 0 for r in result["compare"])  # the interpreter is exact
    assert {r["op"] for r in result["sweep"]} == {"greedy", "random"}
    assert result["best"]["chunk"] == 128 and out.exists()
