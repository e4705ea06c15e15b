"""One registry of the headline metrics: key, label, unit, definition, thresholds, format.

Every key of :class:`analysis.headline.Headline` has exactly one :class:`Metric` here
(docs/design.md §5.11); the verdicts, ``stepscope analyze`` / ``compare`` and the dashboard's
cards read labels, units, definitions and good/warn/bad thresholds from it, never a copy.
``RANK_METRICS`` does the same for the rank-set headline (``analysis.ranks.report``, §5.13),
whose keys are built from it in its order, and ``RANK_TABLE_METRICS`` for the columns of its
per-rank table (the dashboard's rank table reads headers, formats and tooltips from it).
``COMPARED`` lists the numbers ``stepscope compare`` takes deltas of (§5.12): headline keys and
a few of ``Report.extra``'s, each with the path to its value in ``Report.to_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from analysis.metrics.lead import STARVED_LEAD_NS

__all__ = [
    "Metric",
    "Compared",
    "METRICS",
    "METRIC_BY_KEY",
    "RANK_METRICS",
    "RANK_METRIC_BY_KEY",
    "RANK_TABLE_METRICS",
    "RANK_TABLE_METRIC_BY_KEY",
    "COMPARED",
    "metric",
    "fmt_pct",
    "fmt_num",
    "STARVED_LEAD_US",
]

Better = Literal["higher", "lower", ""]
Tone = Literal["good", "warn", "bad", ""]
STARVED_LEAD_US = STARVED_LEAD_NS / 1e3


def fmt_pct(value: float | None) -> str:
    """``37.5%``; ``n/a`` for None or NaN."""
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else f"{100 * value:.1f}%"
    )


def fmt_num(value: float | None, unit: str = "", digits: int = 1) -> str:
    """``1,234.5 ms``; ``n/a`` for None or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}{(' ' + unit) if unit else ''}"


@dataclass(frozen=True)
class Metric:
    """One headline key.

    ``unit``: of the stored value (``ratio`` = a fraction in [0, 1], shown as a percentage;
    ``µs``, ``ms``; ``count``; ``text``; ``id`` for an identifier such as a rank; ``record`` for
    nested dicts/lists). ``better``: which
    direction is good (``""``: no direction, no tone). ``warn``/``bad``: thresholds on the value
    (on ``value / headline[relative_to]`` when ``relative_to`` is set; a list counts its rows):
    past ``bad`` is bad, past ``warn`` a warning, else good ("past" = below for ``higher``, above
    for ``lower``, strictly). ``show_unit``/``show_scale``/``digits``: how a card prints it.
    """

    key: str
    label: str
    unit: str
    definition: str
    section: str  # docs/design.md
    better: Better = ""
    warn: float | None = None
    bad: float | None = None
    relative_to: str | None = None
    show_unit: str | None = None  # None: the unit itself
    show_scale: float = 1.0
    digits: int = 1

    def value_for_tone(self, headline: Mapping[str, Any]) -> float | None:
        """The number the thresholds apply to (None: no tone)."""
        value = headline.get(self.key)
        if isinstance(value, list):
            return float(len(value))
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if self.relative_to is not None:
            return float(value) / max(float(headline.get(self.relative_to) or 0.0), 1e-9)
        return float(value)

    def tone_of(self, value: float | None) -> Tone:
        """``good``/``warn``/``bad`` of a number by this metric's thresholds (``""`` without
        a direction or a value)."""
        if value is None or not self.better or (self.warn is None and self.bad is None):
            return ""
        past = (lambda t: value < t) if self.better == "higher" else (lambda t: value > t)
        if self.bad is not None and past(self.bad):
            return "bad"
        if self.warn is not None and past(self.warn):
            return "warn"
        return "good"

    def tone(self, headline: Mapping[str, Any]) -> Tone:
        """The tone of this metric in ``headline``."""
        return self.tone_of(self.value_for_tone(headline))

    def show(self, value: float | None) -> str:
        """The value as a card prints it (``n/a`` for None)."""
        if self.unit == "ratio":
            return fmt_pct(value)
        if self.unit in ("record", "text"):
            return "n/a" if value is None else str(value)
        unit = self.unit if self.show_unit is None else self.show_unit
        unit = "" if unit == "count" else unit
        scaled = None if value is None else value * self.show_scale
        return fmt_num(scaled, unit, self.digits)


_M = Metric
METRICS: tuple[Metric, ...] = (
    _M(
        "overlap",
        "schedule/forward overlap",
        "ratio",
        "Schedule/forward overlap = |W ∩ B| / |W|. W: union of schedule and prepare_inputs slices "
        "(measured steps); B: union of device compute slices. 1.0 means all CPU scheduling is "
        "hidden under device work.",
        "§5.3",
        "higher",
        warn=0.8,
        bad=0.5,
    ),
    _M(
        "bubble_ratio",
        "bubble ratio",
        "ratio",
        "Σ device idle / window. Idle is the complement of device compute slices inside "
        "[first device slice start, last device slice end] of the measured steps; each "
        "maximal idle interval is a bubble. From stage slices it is a lower bound (a starved "
        "stage's slice covers launch gaps; derived stage begins, --trace-begins derived, are "
        "early if anything); from CUPTI kernels (--trace-kernels, Kineto) it is "
        "measured. Sampled traces: measured inside runs of consecutive kept steps only.",
        "§5.4",
        "lower",
        warn=0.05,
        bad=0.2,
    ),
    _M(
        "device_idle_ratio",
        "device idle",
        "ratio",
        "Share of the window with neither compute nor copy work on the device (compute idle "
        "minus the time copy engines were busy), measured in the same runs as bubble_ratio.",
        "§5.14.4",
        "lower",
        warn=0.05,
        bad=0.2,
    ),
    _M(
        "bubbles",
        "bubbles",
        "record",
        "The idle intervals of bubble_ratio: count, total idle_ms and the largest "
        "(start_ns, dur_us, blame, blame_share).",
        "§5.4",
    ),
    _M(
        "top_blame",
        "top blame for idle",
        "text",
        "The CPU slice running (deepest slice, largest share) during most of the device idle time.",
        "§5.4",
    ),
    _M(
        "wait_accepted_total_us",
        "accepted-count wait",
        "µs",
        "Σ|A|, A = wait_output(accepted_count) slices: the CPU waiting for the accepted counts of "
        "speculative decoding.",
        "§5.5",
    ),
    _M(
        "wait_accepted_exposed_us",
        "exposed accepted-count wait",
        "µs",
        "Accepted-count wait exposure: |A ∩ idle|, A = wait_output(accepted_count) slices. Only "
        "the exposed part is recoverable; the hidden part (|A ∩ B|) waited while the device was "
        "busy, which costs nothing.",
        "§5.5",
        "lower",
        warn=0.0,
        bad=0.1,
        relative_to="wait_accepted_total_us",
        digits=2,
    ),
    _M(
        "wait_accepted_hidden_us",
        "hidden accepted-count wait",
        "µs",
        "|A ∩ B|: accepted-count wait while the device was busy (costs nothing).",
        "§5.5",
    ),
    _M(
        "grammar_mask_ms",
        "grammar masks",
        "ms",
        "Σ|G|, G = grammar_mask slices (the bitmask of step N+1, built once output N is back).",
        "§5.6",
        digits=2,
    ),
    _M(
        "grammar_hidden_frac",
        "grammar work hidden",
        "ratio",
        "Structured output: Σ|G ∩ B| / Σ|G|, G = grammar_mask slices (the bitmask of step N+1, "
        "built once output N is back), B = device compute slices. With deferred sampling the "
        "forward of N+1 runs meanwhile; 'forward early' is the share of masked steps whose "
        "device work began before their mask was built. Exposed grammar wait: "
        "|wait_output(grammar) ∩ idle|.",
        "§5.6",
        "higher",
        warn=0.8,
        bad=0.5,
    ),
    _M(
        "grammar_wait_total_us",
        "grammar wait",
        "µs",
        "Σ|wait_output(grammar)|: the CPU waiting for the output a mask needs.",
        "§5.6",
    ),
    _M(
        "grammar_wait_exposed_us",
        "exposed grammar wait",
        "µs",
        "|wait_output(grammar) ∩ idle|: grammar wait that left the device idle.",
        "§5.6",
        "lower",
    ),
    _M(
        "grammar_overlap_steps_frac",
        "forward early",
        "ratio",
        "Share of masked steps whose device work began before their mask was built (None "
        "without such steps).",
        "§5.6",
    ),
    _M(
        "silent_fallbacks",
        "silent fallbacks",
        "record",
        "Features that ended up off without the user seeing why: requested True resolved "
        "False with no reason, or auto (None) resolved False with the reason not shown to the "
        "user.",
        "§5.7",
        "lower",
        bad=0.0,
    ),
    _M(
        "ineffective",
        "ineffective features",
        "record",
        "The async feature (the profile's async_features) resolved on while overlap is below the "
        "profile's ineffective_overlap (default 0.5): rows of feature, overlap, threshold and "
        "top_blocker (the top blame).",
        "§5.7",
        "lower",
        bad=0.0,
    ),
    _M(
        "hot_syncs",
        "hot syncs after warm-up",
        "count",
        "Host-device syncs (.item(), .tolist(), .cpu(), bool(t), synchronize) marked hot=True "
        "after warm-up: each stalls the CPU until the device drains, a defect on the hot path.",
        "§5.8",
        "lower",
        bad=0.0,
        digits=0,
    ),
    _M(
        "ttft_ms",
        "TTFT",
        "ms",
        "Time to first token per request = end of its last prefill slice − start of its first "
        "slice, from the per-request tracks; {p50, p95, p99, mean, count}.",
        "§5.9",
        "lower",
        digits=2,
    ),
    _M(
        "tpot_ms",
        "TPOT",
        "ms",
        "Time per output token after the first, per request, from the per-request tracks: "
        "(finish − first token) / (output tokens − 1); {p50, p95, p99, mean, count}.",
        "§5.9",
        "lower",
        digits=3,
    ),
    _M(
        "window",
        "measured window",
        "record",
        "The steps measured (rule, first_step, last_step, num_steps, skipped_steps, device "
        "span start_ns/end_ns, duration_ms, note).",
        "§5.2",
    ),
    _M(
        "cpu_lead_us_p50",
        "CPU lead p50",
        "µs",
        "CPU lead = (device time the stream reached a stage's end event) − (host time the CPU "
        "recorded that event), per device stage; a step's lead is its smallest compute stage "
        "lead. p50/p10 over the measured steps. Large: the CPU runs ahead of the device; near "
        "zero: the device caught up and waited for the host.",
        "§5.14.1",
        "higher",
        show_unit="ms",
        show_scale=1e-3,
        digits=2,
    ),
    _M(
        "cpu_lead_us_p10",
        "CPU lead p10",
        "µs",
        "The 10th percentile of the steps' CPU lead (see cpu_lead_us_p50).",
        "§5.14.1",
        "higher",
        warn=10 * STARVED_LEAD_US,  # within 10x of starving: one slow launch away
        bad=STARVED_LEAD_US,
        show_unit="ms",
        show_scale=1e-3,
        digits=2,
    ),
    _M(
        "starved_steps_frac",
        "starved steps",
        "ratio",
        f"Share of measured steps whose CPU lead fell below {STARVED_LEAD_US:.0f} µs: the "
        "device caught up with the host inside the step (starved), so that step's stage slices "
        "also hold launch gaps, not only device work.",
        "§5.14.2",
        "lower",
        warn=0.05,
        bad=0.5,
    ),
    _M(
        "busy_source",
        "busy from",
        "text",
        "Where the busy union B came from: kernels (CUPTI / Kineto), stage_slices, or "
        "kernels_and_stage_slices (kernel windows cover part of the window).",
        "§5.14.3",
    ),
    _M(
        "bubble_ratio_bound",
        "bubble ratio is",
        "text",
        "measured when busy came from kernels; lower_bound when from stage slices (a starved "
        "stage's slice covers launch gaps; derived stage begins are early if anything).",
        "§5.14.2",
    ),
    _M(
        "bubble_ratio_starvation_aware",
        "idle, starvation-aware",
        "ratio",
        "Device idle estimate that counts launch gaps inside starved stages: (stage-slice idle + "
        "Σ estimated gaps) / window. A starved stage's busy time is predicted from unstarved "
        "slices of the same stage (busy ≈ a + b·tokens, least squares); the rest of its slice is "
        "idle, blamed on launch (by phase). Equal to bubble_ratio where busy came from CUPTI "
        "kernels.",
        "§5.14.2",
        "lower",
        warn=0.05,
        bad=0.2,
    ),
)
METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}

_STRAGGLER_SHARE = (
    "Steps whose forward ends last on this rank / steps with a forward on every rank (NaN → null "
    "without such steps)."
)


def _by_rank(definition: str) -> str:
    """A per-rank column's definition, for the headline record that holds it by rank."""
    return "By rank: " + definition[0].lower() + definition[1:]


# The rank-set headline (docs/design.md §5.13): one entry per key, in the headline's order.
# "By rank" entries hold {rank: value}; their thresholds are those of the single-trace entry.
RANK_METRICS: tuple[Metric, ...] = (
    _M("world_size", "ranks", "count", "Tensor-parallel world size of the rank set.", "§5.13"),
    _M(
        "same_host",
        "one host",
        "text",
        "True when every rank ran on one host: clocks are shared and not shifted; otherwise "
        "ranks are shifted by their clock_offset_ns onto rank 0's clock.",
        "§5.13",
    ),
    _M(
        "window",
        "window",
        "record",
        "Rank 0's measured window (rule, first_step, last_step, ...), used for every rank table.",
        "§5.2",
    ),
    _M(
        "overlap",
        "overlap by rank",
        "record",
        "By rank: each rank's own schedule/forward overlap (§5.3) over its own trace.",
        "§5.3",
    ),
    _M(
        "bubble_ratio",
        "bubble ratio by rank",
        "record",
        "By rank: each rank's own bubble ratio (§5.4) over its own trace.",
        "§5.4",
    ),
    _M(
        "all_reduce_wait_us",
        "all-reduce wait by rank",
        "record",
        "By rank: Σ host-timed collectives inside its compute slices + Σ arrival wait (latest "
        "forward start of the step − this rank's), over rank 0's window, in µs.",
        "§5.13",
    ),
    _M(
        "straggler_share",
        "straggler share by rank",
        "record",
        _by_rank(_STRAGGLER_SHARE),
        "§5.13",
    ),
    _M(
        "end_spread_us",
        "forward end spread",
        "record",
        "Percentiles (µs) over steps of the last minus the first rank's forward end.",
        "§5.13",
    ),
)
RANK_METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in RANK_METRICS}


def _own_trace(key: str, label: str) -> Metric:
    """A single-trace headline number, as a column over each rank's own trace."""
    m = METRIC_BY_KEY[key]
    return replace(m, label=label, definition="This rank's own trace. " + m.definition)


# The columns of the rank set's per-rank table (``RankReport.tables["ranks"]``, §5.13), in the
# order the dashboard shows them; ``label`` is the column header. No column has a tone.
RANK_TABLE_METRICS: tuple[Metric, ...] = (
    _M("rank", "rank", "id", "The tensor-parallel rank of the trace.", "§5.13"),
    _M("host", "host", "text", "The host the rank ran on (trace_metadata host).", "§5.13"),
    _own_trace("overlap", "overlap"),
    _own_trace("bubble_ratio", "bubbles"),
    METRIC_BY_KEY["top_blame"],
    _M(
        "forward_ms",
        "forward ms",
        "ms",
        "Σ of this rank's forward time per step (first start to last end of its forward device "
        "slices) over rank 0's window.",
        "§5.13",
    ),
    _M(
        "collective_ms",
        "collectives ms",
        "ms",
        "Σ of the host-timed all_reduce / all_gather slices inside this rank's device slices "
        "(recorded on the CPU / gloo; 0 where collectives are not timed one by one).",
        "§5.13",
    ),
    _M(
        "arrival_wait_ms",
        "arrival wait ms",
        "ms",
        "Σ over steps of (the last rank's forward start − this rank's): what this rank waits at "
        "the step's first collective for the others to arrive.",
        "§5.13",
    ),
    _M(
        "all_reduce_wait_ms",
        "all-reduce wait ms",
        "ms",
        "collectives ms + arrival wait ms.",
        "§5.13",
    ),
    _M(
        "straggler_steps",
        "straggler steps",
        "count",
        "Steps whose forward ends last on this rank (steps with a forward on every rank).",
        "§5.13",
    ),
    _M("straggler_share", "straggler share", "ratio", _STRAGGLER_SHARE, "§5.13"),
    _M(
        "broadcast_idle_ms",
        "broadcast idle ms",
        "ms",
        "Device idle while the engine thread waited in broadcast_step: a worker waiting for rank "
        "0's next step, or rank 0 sending it.",
        "§5.13",
    ),
    _M(
        "clock_offset_us",
        "clock offset µs",
        "µs",
        "This rank's clock minus rank 0's, measured at start-up; traces from other hosts are "
        "shifted by it onto rank 0's clock.",
        "§5.13",
    ),
)
RANK_TABLE_METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in RANK_TABLE_METRICS}


def metric(key: str) -> Metric:
    """The registry entry of a headline key (KeyError names the key)."""
    return METRIC_BY_KEY[key]


@dataclass(frozen=True)
class Compared:
    """A number ``stepscope compare`` takes the delta of: ``path`` into ``Report.to_dict()``;
    ``unit``/``better`` as in :class:`Metric` (from it when ``path`` starts at a headline key)."""

    name: str
    path: tuple[str, ...]
    unit: str
    better: Better


def _headline(key: str, *sub: str) -> Compared:
    """A compared headline number: ``key`` itself or a part of it (``tpot_ms``, ``p50``)."""
    m = METRIC_BY_KEY[key]
    return Compared("_".join((key, *sub)), (key, *sub), m.unit, m.better)


COMPARED: tuple[Compared, ...] = (
    _headline("overlap"),
    _headline("bubble_ratio"),
    _headline("wait_accepted_exposed_us"),
    _headline("grammar_hidden_frac"),
    _headline("grammar_wait_exposed_us"),
    Compared(
        "output_wait_exposed_us_per_step",
        ("extra", "output_wait", "exposed_us_per_step"),
        "µs",
        "lower",
    ),
    Compared("step_ms_p50", ("extra", "step_ms", "p50"), "ms", "lower"),
    _headline("tpot_ms", "p50"),
    _headline("ttft_ms", "p50"),
    Compared("tokens_per_s", ("extra", "tokens_per_s"), "tok/s", "higher"),
    Compared("output_tokens_per_s", ("extra", "output_tokens_per_s"), "tok/s", "higher"),
    _headline("cpu_lead_us_p50"),
    _headline("starved_steps_frac"),
    _headline("bubble_ratio_starvation_aware"),
)
