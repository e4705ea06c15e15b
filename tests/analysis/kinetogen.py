"""Hand-built Kineto (torch.profiler Chrome-JSON) traces with exact timestamps in µs, as
vLLM/SGLang/PyTorch write them: complete ``X`` events, ``thread_name`` metadata, launch→kernel
``correlation`` ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def x(cat: str, name: str, ts: float, dur: float, pid: Any = 1, tid: Any = 1, **args: Any) -> dict:
    """One complete event; ``args`` go into the event's ``args`` (``correlation``, ...)."""
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def kernel(name: str, ts: float, dur: float, correlation: int | None = None) -> dict:
    """A device kernel on GPU 0, stream 7."""
    args: dict[str, Any] = {"device": 0, "stream": 7}
    if correlation is not None:
        args["correlation"] = correlation
    return x("kernel", name, ts, dur, pid=0, tid=7, **args)


def launch(ts: float, correlation: int, tid: Any = 1) -> dict:
    """A ``cudaLaunchKernel`` runtime call of 5 µs on thread ``tid``."""
    return x("cuda_runtime", "cudaLaunchKernel", ts, 5, tid=tid, correlation=correlation)


def thread(tid: Any, name: str, pid: Any = 1) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def profiler_span(ts: float, dur: float) -> dict:
    """The profiler's own whole-capture span (Kineto ``"cat": "Trace"``)."""
    return x("Trace", "PyTorch Profiler (0)", ts, dur, pid="Spans", tid="PyTorch Profiler")


def write_kineto(events: list[dict], path: Path) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path
