"""Colours and the plotly layout defaults shared by every figure.

A slice name has one colour everywhere: in its CPU lane, on the device lane, and on the bubbles
blamed on it, so an idle gap reads at a glance as "the colour of the CPU work that caused it".
"""

from __future__ import annotations

from typing import Any

__all__ = ["color_for", "base_layout", "FONT", "MONO", "GRID", "INK", "MUTED", "IDLE"]

FONT = "Inter, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
MONO = "'JetBrains Mono', 'SFMono-Regular', Menlo, Consolas, monospace"
GRID = "#e6e8ec"
INK = "#1f2430"
MUTED = "#6b7280"
IDLE = "#d64545"

_COLORS: dict[str, str] = {
    # CPU phases
    "schedule": "#4f7fd9",
    "prepare_inputs": "#35a7a0",
    "launch": "#7a6fd0",
    "wait_output": "#e0a526",
    "wait_output(sampled)": "#e0a526",
    "wait_output(accepted_count)": "#e5732e",
    "wait_output(grammar)": "#c9892a",
    "update_from_output": "#8c9aad",
    "grammar_mask": "#b36bb0",
    # device
    "input_prep": "#5fa9d6",
    "forward": "#2f9e5b",
    "sample": "#1f6fb2",
    "verify": "#8e44ad",
    "draft": "#c2185b",
    "h2d_inputs": "#a47551",
    "d2h_output": "#8d6e63",
    # idle
    "(no cpu slice)": "#9aa1ab",
    "(cpu waiting)": "#c4c9d0",
}
_FALLBACK = ["#6c8ebf", "#d6a656", "#82b366", "#b85450", "#9673a6", "#56a0a8", "#c28f5c", "#7f7f7f"]


def color_for(name: str) -> str:
    """A stable colour for a slice name or blame label (unknown names hash into a palette)."""
    if name in _COLORS:
        return _COLORS[name]
    base = name.split("(")[0]
    if base in _COLORS:
        return _COLORS[base]
    return _FALLBACK[sum(map(ord, name)) % len(_FALLBACK)]


def base_layout(**overrides: Any) -> dict[str, Any]:
    """Plotly layout defaults: white, thin grid, compact margins, monospace hover labels."""
    layout: dict[str, Any] = {
        "template": "plotly_white",
        "font": {"family": FONT, "size": 12, "color": INK},
        "margin": {"l": 60, "r": 20, "t": 36, "b": 36},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "hoverlabel": {"font": {"family": MONO, "size": 11}, "bgcolor": "#ffffff"},
        "legend": {
            "orientation": "h",
            "y": 1.02,
            "yanchor": "bottom",
            "x": 0,
            "font": {"size": 11},
        },
        "uirevision": "keep",
    }
    layout.update(overrides)
    return layout
