"""A/B comparison of two traces: the contract check first, then deltas (docs/design.md §5.12)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analysis.loading.derive import OUTPUT_DIGEST_KEY
from analysis.metrics.bubbles import NO_CPU
from analysis.metrics_registry import COMPARED
from analysis.report import Report
from instrument.schema import MEASURED_CONFIG_ARGS, CpuSlice, WaitKind

__all__ = [
    "Comparison",
    "compare_reports",
    "exposed_wait_comparison",
    "compare_output_waits",
    "exposed_wait_line",
    "device_idle_comparison",
    "device_idle_line",
    "wait_and_idle_lines",
    "DERIVED_KEYS",
    "VOLATILE_KEYS",
]

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
    ``deltas``: name -> {a, b, delta}; ``outputs_agree``: True/False, None without digests;
    ``exposed_wait``: :func:`exposed_wait_comparison` when either trace is a speculative run
    (None otherwise); ``device_idle``: :func:`device_idle_comparison` (None when a side
    measured no steps)."""

    contract_ok: bool
    differences: dict[str, tuple[Any, Any]]
    violations: list[str]
    deltas: dict[str, dict[str, float | None]]
    outputs_agree: bool | None
    notes: list[str] = field(default_factory=list)
    checked: bool = True
    exposed_wait: dict[str, Any] | None = None
    device_idle: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "contract_ok": self.contract_ok,
            "contract_checked": self.checked,
            "differences": {k: list(v) for k, v in self.differences.items()},
            "violations": self.violations,
            "deltas": self.deltas,
            "outputs_agree": self.outputs_agree,
            "notes": self.notes,
            "exposed_wait": self.exposed_wait,
            "device_idle": self.device_idle,
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
    exposed = exposed_wait_comparison(a, b) if _is_spec(a) or _is_spec(b) else None
    idle = device_idle_comparison(a, b)
    return Comparison(
        not violations, diffs, violations, deltas, agree, notes, checked, exposed, idle
    )


def _is_spec(r: Report) -> bool:
    """A speculative run: its config names a proposer, or it waited for accepted counts."""
    method = r.frames.config.get("spec_method")
    waits = r.extra.get("output_wait", {}).get("by_kind", {})
    return method not in (None, "", "None", "none") or WaitKind.ACCEPTED_COUNT.value in waits


def exposed_wait_comparison(a: Report, b: Report) -> dict[str, Any]:
    """The host's waits for step output that left the device idle, per step, on both sides
    (docs/design.md §5.5, §5.12): :func:`compare_output_waits` of the reports'
    ``extra["output_wait"]``."""
    return compare_output_waits(a.extra.get("output_wait"), b.extra.get("output_wait"))


def compare_output_waits(
    wait_a: dict[str, Any] | None, wait_b: dict[str, Any] | None
) -> dict[str, Any]:
    """Two ``analysis.metrics.waits.exposed_wait_summary`` results side by side. Per side
    (``a``, ``b``): ``exposed_us_per_step`` (Σ over every ``wait_output`` kind),
    ``exposed_share`` (of the measured step time), ``num_steps`` and ``by_kind`` (exposed µs
    per step, share, µs per step of the wait before the step's output reached the host, and
    µs per step of ``read_output`` host work after the wait, never counted as wait);
    then ``delta_us_per_step`` and ``delta_share`` (b − a; None where a side has no steps)."""
    sides = {}
    for name, ow in (("a", wait_a or {}), ("b", wait_b or {})):
        sides[name] = {
            "exposed_us_per_step": ow.get("exposed_us_per_step"),
            "exposed_share": ow.get("exposed_share"),
            "num_steps": ow.get("num_steps", 0),
            "by_kind": {
                k: {
                    "exposed_us_per_step": v["exposed_us_per_step"],
                    "exposed_share": v["exposed_share"],
                    "device_wait_us_per_step": v.get("device_wait_us_per_step"),
                    "read_us_per_step": v.get("read_us_per_step"),
                }
                for k, v in (ow.get("by_kind") or {}).items()
            },
        }

    def delta(key: str) -> float | None:
        va, vb = sides["a"][key], sides["b"][key]
        return None if va is None or vb is None else vb - va

    return {
        **sides,
        "delta_us_per_step": delta("exposed_us_per_step"),
        "delta_share": delta("exposed_share"),
    }


def exposed_wait_line(cmp: dict[str, Any]) -> str:
    """One sentence: each side's exposed output waits (kind, µs/step, share of step time, and
    the part spent before the step's output reached the host) and the difference; ``cmp`` from
    :func:`exposed_wait_comparison`. Ends with a warning when neither side waited for the
    device (each wait's part before the copy ended under 5% of its exposed time)."""

    def kind(k: str, v: dict[str, Any]) -> str:
        dev, read = v.get("device_wait_us_per_step"), v.get("read_us_per_step")
        tail = (
            ""
            if dev is None
            else f"; {_us(dev)}/step of the wait before the output reached the host"
        )
        if read:  # a trace with read_output: the host work after the wait, not a wait
            tail += f"; then read_output {_us(read)}/step of host work"
        return (
            f"wait_output({k}) {_us(v['exposed_us_per_step'])}/step "
            f"({_pct(v['exposed_share'])} of step time{tail})"
        )

    def side(name: str) -> str:
        kinds = [kind(k, v) for k, v in cmp[name]["by_kind"].items()]
        return f"{name.upper()} " + (", ".join(kinds) if kinds else "no wait_output slices")

    d_us, d_share = cmp["delta_us_per_step"], cmp["delta_share"]
    diff = (
        "n/a"
        if d_us is None or d_share is None
        else f"{d_us:+,.1f} µs/step ({100 * d_share:+.2f} points of step time)"
    )
    line = (
        "exposed wait for step output (device idle while the host waits): "
        f"{side('a')}; {side('b')}; B − A {diff}."
    )
    kinds = [v for name in ("a", "b") for v in cmp[name]["by_kind"].values()]
    if kinds and all(
        v.get("device_wait_us_per_step") is not None
        and v["device_wait_us_per_step"] < 0.05 * (v["exposed_us_per_step"] or 0.0)
        for v in kinds
    ):
        line += (
            " Neither side waited for the device: each output had reached the host before the"
            " wait began, so the waits hold host work (reading the output), not device time."
        )
    return line


# Blamed CPU phases named per side in the device-idle line.
IDLE_BLAME_TOP = 4
# A side "serialises host work after its accepted-count wait" when the device idled at least this
# many times longer per step than that wait itself left it idle, that idle is at least
# SERIAL_MIN_SHARE of step time, and CPU phases other than output waits (named CPU slices, not
# "(no cpu slice)") ran through at least half of it.
SERIAL_FACTOR = 5.0
SERIAL_MIN_SHARE = 0.05


def _idle_side(r: Report) -> dict[str, Any] | None:
    """One report's device idle per measured step: the bubbles of the window (idle between the
    device slices, docs/design.md §5.3) per step and as a share of step time, the starvation-
    aware estimate of that share (§5.14), and the CPU phases running during the idle (the blame
    table, §5.4: ``label`` -> µs per step, largest first; with several threads at once each gets
    the time, so they may sum past the idle). None when the window has no steps."""
    steps = int((r.headline["window"] or {}).get("num_steps") or 0)
    ratio = r.headline["bubble_ratio"]
    if not steps or ratio is None:
        return None
    bubbles = r.tables.get("bubbles")
    idle_ns = int(bubbles["dur_ns"].sum()) if bubbles is not None and len(bubbles) else 0
    blame = r.tables.get("blame")
    by_label: dict[str, float] = {}
    if blame is not None:
        for row in blame.head(IDLE_BLAME_TOP).itertuples():
            by_label[str(row.label)] = int(row.idle_ns) / 1e3 / steps
    return {
        "num_steps": steps,
        "idle_us_per_step": idle_ns / 1e3 / steps,
        "idle_share": ratio,
        "starvation_aware_share": r.headline["bubble_ratio_starvation_aware"],
        "lower_bound": r.headline["bubble_ratio_bound"] == "lower_bound",
        "blame_us_per_step": by_label,
    }


def device_idle_comparison(a: Report, b: Report) -> dict[str, Any] | None:
    """Device idle per step on both sides and what the host ran meanwhile (:func:`_idle_side`),
    with ``delta_us_per_step`` and ``delta_share`` (b − a). This is the cost a serial loop pays
    that an exposed-wait figure does not show: a loop that waits for step N's accepted counts
    (``--spec-sync-accepted``) while the device is busy exposes little of the wait itself, then
    leaves the device idle while it updates, schedules, prepares and launches step N+1 (docs/
    design.md §5.12). None when either side measured no steps."""
    sa, sb = _idle_side(a), _idle_side(b)
    if sa is None or sb is None:
        return None
    return {
        "a": sa,
        "b": sb,
        "delta_us_per_step": sb["idle_us_per_step"] - sa["idle_us_per_step"],
        "delta_share": sb["idle_share"] - sa["idle_share"],
    }


def device_idle_line(idle: dict[str, Any], exposed: dict[str, Any] | None = None) -> str:
    """One sentence: each side's device idle per step (share of step time, the starvation-aware
    estimate where it is higher) with the CPU phases running meanwhile, and B − A. With
    ``exposed`` (:func:`exposed_wait_comparison`), a side that waited for accepted counts and
    idled at least ``SERIAL_FACTOR`` times longer than that wait exposed, for at least
    ``SERIAL_MIN_SHARE`` of its step time, mostly while named CPU phases ran, is named: its cost
    is the host work serialised after the wait, not the wait."""

    def side(name: str) -> str:
        v = idle[name]
        share = f"{_pct(v['idle_share'])} of step time"
        est = v["starvation_aware_share"]
        if est is not None and est > v["idle_share"] + 0.005:
            share += f", about {_pct(est)} counting starved stages"
        blamed = ", ".join(f"{k} {_us(us)}" for k, us in v["blame_us_per_step"].items())
        during = f"; meanwhile the host ran {blamed} per step" if blamed else ""
        return f"{name.upper()} {_us(v['idle_us_per_step'])}/step ({share}{during})"

    bound = any(idle[n]["lower_bound"] for n in ("a", "b"))
    line = (
        "device idle per step (bubbles between device slices"
        + ("; a lower bound where slices span launch gaps" if bound else "")
        + f"): {side('a')}; {side('b')}; "
        f"B − A {idle['delta_us_per_step']:+,.1f} µs/step "
        f"({100 * idle['delta_share']:+.2f} points of step time)."
    )
    if exposed is None:
        return line
    for name in ("a", "b"):
        acc = exposed[name]["by_kind"].get(WaitKind.ACCEPTED_COUNT.value)
        if acc is None or acc["exposed_us_per_step"] is None:
            continue
        waited = acc["exposed_us_per_step"]
        idle_us = idle[name]["idle_us_per_step"]
        host_us = sum(
            us
            for label, us in idle[name]["blame_us_per_step"].items()
            if label != NO_CPU and not label.startswith(CpuSlice.WAIT_OUTPUT.value)
        )
        if (
            idle_us >= SERIAL_FACTOR * max(waited, 1.0)
            and idle[name]["idle_share"] >= SERIAL_MIN_SHARE
            and host_us >= 0.5 * idle_us
        ):
            other = "b" if name == "a" else "a"
            line += (
                f" {name.upper()} waits for accepted counts: the wait itself left the device idle"
                f" {_us(waited)}/step, the host work after it (reading the output, update,"
                f" schedule, prepare and launch of the next step) {_us(idle_us - waited)}/step;"
                f" {other.upper()} idles {_us(idle[other]['idle_us_per_step'])}/step."
            )
    return line


def wait_and_idle_lines(cmp: Comparison) -> list[str]:
    """The sentences ``stepscope compare`` and the dashboard's compare view print after the
    contract: the exposed output waits (speculative runs) and the device idle per step."""
    lines = []
    if cmp.exposed_wait is not None:
        lines.append(exposed_wait_line(cmp.exposed_wait))
    if cmp.device_idle is not None:
        lines.append(device_idle_line(cmp.device_idle, cmp.exposed_wait))
    return lines


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f} µs"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"
