"""Trace profiles: which range names of an engine mean stepscope's ``schedule``, ``launch``, ...

A profile maps raw CPU range names (``record_function`` / ``user_annotation`` names in Kineto
traces, span names in Perfetto traces) onto the canonical names of docs/design.md §4.2 (profiles: §6) through an
ordered list of regex rules (first match wins). Built in: ``stepscope`` (identity), ``vllm``,
``sglang``. A user profile is a JSON or TOML file::

    # myengine.toml
    name = "myengine"                         # shown in reports
    step_pattern = "^ProfilerStep#(\\d+)$"     # optional: ranges that envelope one step;
                                              # group 1, when present, is the step number
    ineffective_overlap = 0.5                 # optional: async "on" but overlap below this
    [[rules]]
    pattern = "^MyScheduler\\.schedule$"      # Python regex, searched in the raw name
    name = "schedule"                         # canonical name (docs/design.md §4.2)
    [[rules]]
    pattern = "wait_for_accepted"
    name = "wait_output"
    kind = "accepted_count"                   # optional: sets the slice's ``kind``

(JSON: the same keys, ``{"name": ..., "rules": [{"pattern": ..., "name": ...}]}``.)
Rules apply to CPU slices and device-side annotations; kernels keep their own names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.frames import ROLE_ANNOTATION, ROLE_CPU, TraceError
from instrument.schema import CpuSlice, WaitKind

__all__ = ["NameRule", "Profile", "get_profile", "load_profile_file", "PROFILES"]

_CANONICAL = {s.value for s in CpuSlice}
_STEP = CpuSlice.STEP.value


@dataclass(frozen=True)
class NameRule:
    """Raw names matching ``pattern`` (``re.search``) become ``name`` (with ``kind`` if set)."""

    pattern: str
    name: str
    kind: str = ""

    def __post_init__(self) -> None:
        if self.name not in _CANONICAL:
            raise ValueError(
                f"rule {self.pattern!r}: {self.name!r} is not a canonical CPU slice name "
                f"({', '.join(sorted(_CANONICAL))})"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"rule pattern {self.pattern!r} is not a valid regex: {exc}") from None


@dataclass(frozen=True)
class Profile:
    """A named mapping from an engine's range names onto stepscope's canonical names."""

    name: str
    rules: tuple[NameRule, ...] = ()
    step_pattern: str | None = None
    ineffective_overlap: float = 0.5
    async_features: tuple[str, ...] = ("async_scheduling", "async_schedule", "async")
    envelopes: tuple[str, ...] = field(default=(_STEP,))

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a profile needs a name")
        if not 0.0 <= self.ineffective_overlap <= 1.0:
            raise ValueError(
                f"ineffective_overlap must be in [0, 1], got {self.ineffective_overlap}"
            )
        if self.step_pattern is not None:
            re.compile(self.step_pattern)

    def map_name(self, raw: str) -> tuple[str, str, int]:
        """``(canonical name, kind, step)`` for one raw name; unmapped names keep themselves."""
        if self.step_pattern is not None:
            match = re.search(self.step_pattern, raw)
            if match:
                step = int(match.group(1)) if match.groups() and match.group(1) else -1
                return _STEP, "", step
        for rule in self.rules:
            if re.search(rule.pattern, raw):
                return rule.name, rule.kind, -1
        return raw, "", -1

    def apply(self, slices: pd.DataFrame) -> pd.DataFrame:
        """Rename mapped CPU/annotation slices in place of ``name``; ``raw_name`` keeps the original.

        ``name`` and ``kind`` come back as plain text columns (the loader categorizes them after).

        Works per distinct name, so the cost is one dict lookup per row.
        """
        if (not self.rules and self.step_pattern is None) or slices.empty:
            return slices
        target = slices["role"].isin([ROLE_CPU, ROLE_ANNOTATION]).to_numpy()
        raw = slices.loc[target, "raw_name"]
        table = {r: self.map_name(r) for r in pd.unique(raw)}
        mapped = [table[r] for r in raw.tolist()]
        if not mapped:
            return slices
        names, kinds, steps = (np.asarray(x, dtype=object) for x in zip(*mapped, strict=False))
        name_col = slices["name"].to_numpy(object).copy()
        name_col[target] = names
        slices["name"] = name_col
        has_kind = kinds != ""
        kind_col = slices["kind"].to_numpy(object).copy()
        kind_col[np.nonzero(target)[0][has_kind]] = kinds[has_kind]
        slices["kind"] = kind_col
        steps = steps.astype(np.int64)
        has_step = steps >= 0
        step_col = slices["step"].to_numpy(np.int64).copy()
        step_col[np.nonzero(target)[0][has_step]] = steps[has_step]
        slices["step"] = step_col
        return slices


_R = NameRule
PROFILES: dict[str, Profile] = {
    "stepscope": Profile("stepscope"),
    "vllm": Profile(
        "vllm",
        rules=(
            _R(r"^core step[\w ]*: schedul", "schedule"),
            _R(r"^gpu_model_runner: preprocess$", "prepare_inputs"),
            _R(r"^gpu_model_runner: (forward|sample|draft|propose)", "launch"),
            _R(r"^gpu_model_runner: (postprocess|bookkeep)", "update_from_output"),
            _R(r"^core step[\w ]*: (update_from_output|process_output)", "update_from_output"),
            _R(
                r"^core step[\w ]*: (get_output|wait|future)", "wait_output", WaitKind.SAMPLED.value
            ),
            _R(r"(structured_output|grammar_bitmask|apply_grammar)", "grammar_mask"),
        ),
        step_pattern=r"^ProfilerStep#(\d+)$",
    ),
    "sglang": Profile(
        "sglang",
        rules=(
            _R(r"get_next_batch_to_run", "schedule"),
            _R(r"(prepare_for_extend|prepare_for_decode|ForwardBatch\.init_new)", "prepare_inputs"),
            _R(r"(forward_batch_generation|run_batch)", "launch"),
            _R(r"process_batch_result", "update_from_output"),
            _R(
                r"(resolve_(last_)?batch_result|copy_done\.synchronize)",
                "wait_output",
                WaitKind.SAMPLED.value,
            ),
            _R(r"(grammar|vocab_mask)", "grammar_mask"),
        ),
        step_pattern=r"^ProfilerStep#(\d+)$",
    ),
}


def _from_mapping(raw: dict[str, Any], source: str) -> Profile:
    known = {"name", "rules", "step_pattern", "ineffective_overlap"}
    unknown = set(raw) - known
    if unknown:
        raise TraceError(f"profile {source}: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        rules = tuple(
            NameRule(str(r["pattern"]), str(r["name"]), str(r.get("kind", "")))
            for r in raw.get("rules", [])
        )
        return Profile(
            name=str(raw.get("name", Path(source).stem)),
            rules=rules,
            step_pattern=raw.get("step_pattern"),
            ineffective_overlap=float(raw.get("ineffective_overlap", 0.5)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"profile {source}: {exc}") from None


def load_profile_file(path: str | Path) -> Profile:
    """A user profile from a ``.json`` or ``.toml`` file (format in the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read profile {p}: {exc.strerror}") from None
    try:
        if p.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except ValueError as exc:
        raise TraceError(
            f"profile {p} is not valid {p.suffix.lstrip('.') or 'JSON'}: {exc}"
        ) from None
    if not isinstance(raw, dict):
        raise TraceError(f"profile {p}: expected a table/object at the top level")
    return _from_mapping(raw, str(p))


def get_profile(spec: Profile | str) -> Profile:
    """A built-in profile by name, a profile file by path, or ``spec`` itself."""
    if isinstance(spec, Profile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    if Path(spec).suffix in (".json", ".toml"):
        return load_profile_file(spec)
    raise TraceError(
        f"unknown profile {spec!r}: use one of {', '.join(PROFILES)} or a .json/.toml file"
    )
