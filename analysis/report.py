"""The diagnosis of one trace: headline numbers (docs/design.md §5.11 names), tables, plain-words verdicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from analysis.analyzers import ANALYZERS, MAX_HEADLINE_BUBBLES, TABLE_ORDER, Pass
from analysis.frames import TraceFrames
from analysis.headline import HEADLINE_KEYS, Headline
from analysis.loading.profiles import Profile, get_profile
from analysis.metrics.runs import runs_verdict
from analysis.metrics.window import WINDOW_STEADY
from analysis.records import clean as _clean
from analysis.records import records as _records
from analysis.verdicts import verdicts

__all__ = ["Report", "build_report", "HEADLINE_KEYS", "Headline", "MAX_HEADLINE_BUBBLES"]


@dataclass
class Report:
    """Everything ``stepscope analyze`` says about one trace.

    ``headline``: the frozen :class:`~analysis.headline.Headline` (docs/design.md §5.11 names;
    labels, units and thresholds in ``analysis.metrics_registry``); ``verdicts``: plain
    sentences, most important first; ``tables``: ``steps``, ``overlap``, ``bubbles``, ``blame``,
    ``waits``, ``grammar`` (``analysis.metrics.grammar.grammar_by_step``), ``syncs``, ``decisions``,
    ``silent_fallbacks``, ``ineffective``, ``latency``, ``runs`` (``analysis.metrics.runs``),
    ``stage_lead``, ``starved``, ``starvation`` and ``fill`` (``analysis.lead_report``),
    ``kernel_types`` and ``top_kernels`` (``analysis.metrics.kernels.kernel_breakdown`` over the window)
    frames;
    ``frames``: the loaded trace; ``extra``: secondary numbers (throughput, step time, e2e).
    """

    headline: Headline
    verdicts: list[str]
    tables: dict[str, pd.DataFrame]
    frames: TraceFrames
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, with_tables: bool = True) -> dict[str, Any]:
        """JSON-ready: headline, verdicts, extra, metadata and (optionally) every table."""
        out: dict[str, Any] = {
            **self.headline.to_dict(),
            "verdicts": self.verdicts,
            "extra": self.extra,
            "metadata": _clean(self.frames.metadata),
            "config": _clean(self.frames.config),
        }
        if with_tables:
            out["tables"] = {k: _records(v) for k, v in self.tables.items()}
        return out


def build_report(
    frames: TraceFrames,
    profile: Profile | str | None = None,
    skip_steps: int = 1,
    window: str = WINDOW_STEADY,
    parallel: bool = False,
) -> Report:
    """Compute every metric of docs/design.md §5 on loaded frames, over ``window`` (``steady``,
    ``all`` or ``A:B``; see ``analysis.metrics.window.select_window``): the analyzers of
    ``analysis.analyzers.ANALYZERS`` in order, then the verdicts. ``parallel``: a large trace's
    bubble blame may run in a forked child meanwhile (``analysis.forked``; same result)."""
    prof = get_profile(profile or frames.metadata.get("profile", "stepscope"))
    p = Pass(frames, prof, skip_steps, window, parallel=parallel)
    for analyze in ANALYZERS:
        analyze(p)
    headline = Headline(**p.head)
    tables = {**{name: p.tables[name] for name in TABLE_ORDER if name in p.tables}, **p.tables}
    says = verdicts(headline, frames, p.extra)
    sampled = [v for v in [runs_verdict(p.runs)] if v]
    return Report(headline, says[:1] + p.verdicts + sampled + says[1:], tables, frames, p.extra)
