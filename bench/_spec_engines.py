"""bench/bench_spec.py's engines: one traced engine per variant, built once and reused by every
pass; each pass remembers its steps so the trace can be analysed pass by pass."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.llm import LLM
from engine.workload import WorkloadRequest
from instrument.tracer import Tracer

__all__ = ["Variant", "parse_variants", "SpecEngine", "PassRecord", "SPEC_MODELS"]

MODELS = "samples/models"
TARGET = f"{MODELS}/pycoder-14m"
# The proposer each method loads beside the target (n-gram needs none).
SPEC_MODELS: dict[str, str | None] = {
    "ngram": None,
    "draft": f"{MODELS}/pycoder-draft-2m",
    "eagle": f"{MODELS}/pycoder-14m-eagle",
    "mtp": f"{TARGET}/mtp",
}


@dataclass(frozen=True)
class Variant:
    """One engine configuration: ``method`` None = no speculation; ``k`` draft tokens per step;
    ``sync``: ``spec_sync_accepted`` (the host waits for accepted counts before preparing N+1)."""

    method: str | None
    k: int = 0
    sync: bool = False

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPEC_MODELS:
            raise ValueError(f"unknown spec method {self.method!r}: one of {sorted(SPEC_MODELS)}")
        if self.method is not None and self.k < 1:
            raise ValueError(f"{self.method}: k must be >= 1, got {self.k}")
        if self.method is None and (self.k or self.sync):
            raise ValueError("'none' takes no k and no sync")

    @property
    def name(self) -> str:
        if self.method is None:
            return "none"
        return f"{self.method} k={self.k}{' sync' if self.sync else ''}"

    @property
    def tag(self) -> str:
        """The name as a file name."""
        return self.name.replace(" ", "_").replace("=", "")

    def engine_kwargs(self) -> dict[str, Any]:
        if self.method is None:
            return {}
        return {
            "spec_method": self.method,
            "spec_model": SPEC_MODELS[self.method],
            "num_spec_tokens": self.k,
            "spec_sync_accepted": self.sync,
        }


def parse_variants(text: str) -> list[Variant]:
    """``none,ngram:1,draft:2,eagle:3,mtp:3,eagle:3:sync`` -> variants (``none`` first, added
    when missing: every ratio is against it)."""
    out: list[Variant] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if parts[0] == "none":
            v = Variant(None)
        else:
            if len(parts) < 2 or not parts[1].isdigit() or parts[2:] not in ([], ["sync"]):
                raise ValueError(f"variant {item!r}: write METHOD:K or METHOD:K:sync")
            v = Variant(parts[0], int(parts[1]), parts[2:] == ["sync"])
        if v in out:
            raise ValueError(f"variant {item!r} given twice")
        out.append(v)
    return [Variant(None)] + [v for v in out if v.method is not None]


@dataclass
class PassRecord:
    """One pass of a workload on one engine: wall time, output tokens, the trace's steps
    ``first_step..end_step-1`` and every request's tokens."""

    label: str  # "warm", "round <i>" or "traced"
    elapsed_s: float
    output_tokens: int
    first_step: int
    end_step: int
    tokens: dict[str, list[int]] = field(repr=False)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")


class SpecEngine:
    """A variant's engine and tracer (``<trace_dir>/<tag>.pftrace``), built once; the engine
    warms itself where warm-up is on (CUDA: engine/warmup.py). ``build_s``: construction time."""

    def __init__(self, variant: Variant, trace_dir: str, **engine_kwargs: Any) -> None:
        self.variant = variant
        self.trace_path = os.path.join(trace_dir, f"{variant.tag}.pftrace")
        start = time.perf_counter()
        self.tracer = Tracer(self.trace_path, writer="process")
        self.llm = LLM(
            tracer=self.tracer, trace_requests=False, **engine_kwargs, **variant.engine_kwargs()
        )
        self.build_s = time.perf_counter() - start
        self.passes: list[PassRecord] = []

    def run(self, label: str, workload: list[WorkloadRequest], traced: bool = True) -> PassRecord:
        """Run ``workload`` (every request to its end) and record the pass; ``traced=False``
        mutes the tracer for it (as a run without ``--trace``: nothing recorded)."""
        first = self.llm.engine.scheduler.next_step
        with contextlib.nullcontext() if traced else self.tracer.muted():
            start = time.perf_counter()
            outs = self.llm.run_workload(workload)
            elapsed = time.perf_counter() - start
        # Ship this pass's events to the writer now, outside the timed window: left to the
        # flusher thread, the backlog is pickled (holding the GIL) during the next variant's
        # timed pass. On the H200 the same variant's step p50 swung 4.0 <-> 6.0 ms by round.
        self.tracer.flush()
        failed = [o.id for o in outs if o.error is not None]
        if failed:
            raise RuntimeError(f"{self.variant.name}: requests failed: {failed[:5]}")
        record = PassRecord(
            label,
            elapsed,
            sum(len(o.output_token_ids) for o in outs),
            first,
            self.llm.engine.scheduler.next_step,
            {o.id: list(o.output_token_ids) for o in outs},
        )
        self.passes.append(record)
        return record

    def close(self) -> None:
        """Close the engine and flush the trace (then it can be analysed)."""
        self.llm.close()
        self.tracer.close()
