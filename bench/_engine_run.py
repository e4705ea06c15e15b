"""Shared by the engine benchmarks: run a fixed-shape workload on EngineCore with a trace."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass

import pandas as pd
import torch

from analysis import analyze_trace
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.workload import WorkloadRequest
from instrument.tracer import Tracer


@dataclass
class RunResult:
    trace: str
    elapsed_s: float
    num_output_tokens: int
    steps: pd.DataFrame  # analysis step table
    headline: dict
    model: object
    kineto_steps: int = 0
    first_profiled_step: int | None = None  # trace steps from this one on ran under the profiler


def decode_workload(
    batch: int, prompt_len: int, output_len: int, vocab: int, prefix: str = "b", salt: int = 0
) -> list[WorkloadRequest]:
    """``batch`` requests arriving together: a prompt of ``prompt_len`` ids, ``output_len`` tokens."""
    return [
        WorkloadRequest(
            f"{prefix}{i}",
            None,
            tuple((7 * i + 13 * j + salt) % (vocab - 2) + 2 for j in range(prompt_len)),
            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
        )
        for i in range(batch)
    ]


def run_engine(
    workload: list[WorkloadRequest],
    trace_dir: str | None = None,
    tag: str = "run",
    kineto_path: str | None = None,
    kineto_steps: tuple[int, int] = (40, 60),
    **engine_kwargs,
) -> RunResult:
    """Warm up, then run ``workload`` traced; ``kineto_path``: also record engine steps
    ``kineto_steps`` of the measured run with torch.profiler (CPU + CUDA activities) and export
    them there as a Kineto JSON trace (``RunResult.kineto_steps`` says how many steps it holds)."""
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="stepscope-bench-")
    path = os.path.join(trace_dir, f"{tag}.pftrace")
    tracer = Tracer(path)
    llm = LLM(tracer=tracer, trace_requests=False, **engine_kwargs)
    # Warm-up: the same batch shape with short outputs (kernels compiled for these shapes), own
    # ids and reversed prompts (no prefix-cache hits on the measured requests).
    warm = [
        dataclasses.replace(
            w,
            id=f"warm-{w.id}",
            prompt_token_ids=tuple(reversed(w.prompt_token_ids or ())),
            params=dataclasses.replace(w.params, max_tokens=4),
        )
        for w in workload
    ]
    llm.run_workload(warm)
    window = _ProfiledSteps(llm, kineto_path, kineto_steps) if kineto_path else None
    start = time.monotonic()
    outs = llm.run_workload(workload)
    elapsed = time.monotonic() - start
    if window is not None:
        window.close()
    llm.close()
    tracer.close()
    report = analyze_trace(path)
    return RunResult(
        path,
        elapsed,
        sum(len(o.output_token_ids) for o in outs),
        report.tables["steps"],
        report.headline.to_dict(),
        llm.engine.model,
        window.num_steps if window is not None else 0,
        window.first_traced_step if window is not None else None,
    )


class _ProfiledSteps:
    """torch.profiler (CPU + CUDA) over engine steps ``[first, last)`` of the measured run,
    exported as a Kineto JSON trace: wraps ``llm.engine.run_step``."""

    def __init__(self, llm: LLM, path: str, steps: tuple[int, int]) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.path, (self.first, self.last) = path, steps
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.count, self.active = 0, False
        self.first_traced_step: int | None = None
        self.engine = llm.engine
        run_step = self.engine.run_step

        def wrapped():  # type: ignore[no-untyped-def]
            if self.count == self.first:
                # trace step numbers from here on run (partly) under the profiler
                self.first_traced_step = getattr(self.engine.scheduler, "_next_step", None)
                self.prof.start()
                self.active = True
            if self.count == self.last:
                self.close()
            self.count += 1
            return run_step()

        self.engine.run_step = wrapped  # type: ignore[method-assign]
        self._restore = run_step

    def close(self) -> None:
        if self.active:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.stop()
            self.prof.export_chrome_trace(self.path)
            self.active = False
        self.engine.run_step = self._restore  # type: ignore[method-assign]

    @property
    def num_steps(self) -> int:
        return min(self.count, self.last) - self.first


def decode_steps(steps: pd.DataFrame, batch: int) -> pd.DataFrame:
    """Steady decode steps: exactly ``batch`` requests, one token each."""
    s = steps
    if "num_tokens" in s.columns and "num_reqs" in s.columns:
        s = s[(s["num_reqs"] == batch) & (s["num_tokens"] == batch)]
    return s.iloc[2:-2] if len(s) > 8 else s
