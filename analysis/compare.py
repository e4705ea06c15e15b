"""A/B comparison of two traces: the contract check first, then deltas (docs/design.md §5.12)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analysis.loading.derive import OUTPUT_DIGEST_KEY
from analysis.metrics_registry import COMPARED
from analysis.report import Report
from instrument.schema import MEASURED_CONFIG_ARGS

__all__ = ["Comparison", "compare_reports", "DERIVED_KEYS", "VOLATILE_KEYS"]

# Config/metadata keys that differ between any two runs and say nothing about the contract.
VOLATILE_KEYS = (
    frozenset({"pid", "wall_time_ns", "trace_path", "output_path", "seed_offset", "run_id"})
    | MEASURED_CONFIG_ARGS
)
# Config keys that follow from other keys and the feature decisions (the captured CUDA-graph
# shapes, docs/design.md §2.6): toggling the one variable under test changes them too.
DERIVED_KEYS = frozenset({"cuda_graph_sizes", "mixed_graph_buckets"})


@dataclass
class Comparison:
    """``contract_ok``: configs equal except the declared variables (True when neither trace
    carries a config: nothing contradicts it, and ``checked`` is False); ``differences``: key ->
    (A, B) for every differing config key; ``violations``: differing keys not declared;
    ``deltas``: name -> {a, b, delta}; ``outputs_agree``: True/False, None without digests."""

    contract_ok: bool
    differences: dict[str, tuple[Any, Any]]
    violations: list[str]
    deltas: dict[str, dict[str, float | None]]
    outputs_agree: bool | None
    notes: list[str] = field(default_factory=list)
    checked: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "contract_ok": self.contract_ok,
            "contract_checked": self.checked,
            "differences": {k: list(v) for k, v in self.differences.items()},
            "violations": self.violations,
            "deltas": self.deltas,
            "outputs_agree": self.outputs_agree,
            "notes": self.notes,
        }


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float | None:
    cur: Any = d
    for key in path:
        if not isinstance(cur, dict) or cur.get(key) is None:
            return None
        cur = cur[key]
    return float(cur) if isinstance(cur, (int, float)) else None


def compare_reports(a: Report, b: Report, vary: tuple[str, ...] = ()) -> Comparison:
    """Check the A/B contract from the traces' ``engine_config`` and compare the headline numbers.

    With ``vary`` empty, exactly one differing config key is allowed (the variable under test);
    otherwise only the keys in ``vary`` may differ.
    """
    ca, cb = a.frames.config, b.frames.config
    keys = sorted((set(ca) | set(cb)) - VOLATILE_KEYS - DERIVED_KEYS - {OUTPUT_DIGEST_KEY})
    diffs = {k: (ca.get(k), cb.get(k)) for k in keys if ca.get(k) != cb.get(k)}
    notes: list[str] = []
    if not ca and not cb:
        notes.append("neither trace carries an engine_config: the contract cannot be checked")
    violations = (
        [k for k in diffs if k not in vary] if vary else (list(diffs) if len(diffs) > 1 else [])
    )
    da, db = a.to_dict(with_tables=False), b.to_dict(with_tables=False)
    deltas: dict[str, dict[str, float | None]] = {}
    for c in COMPARED:
        va, vb = _get(da, c.path), _get(db, c.path)
        deltas[c.name] = {
            "a": va,
            "b": vb,
            "delta": (vb - va) if va is not None and vb is not None else None,
        }
    ga, gb = a.frames.metadata.get(OUTPUT_DIGEST_KEY), b.frames.metadata.get(OUTPUT_DIGEST_KEY)
    agree = None if ga is None or gb is None else ga == gb
    if agree is None:
        notes.append(f"outputs not compared: '{OUTPUT_DIGEST_KEY}' missing from one or both traces")
    checked = bool(ca or cb)
    return Comparison(not violations, diffs, violations, deltas, agree, notes, checked)
