"""Trace profiles: which range names of an engine mean stepscope's ``schedule``, ``launch``, ...

A profile maps raw CPU range names (``record_function`` / ``user_annotation`` names in Kineto
traces, span names in Perfetto traces) onto the canonical names of docs/design.md §4.2 (profiles: §6) through an
ordered list of regex rules (first match wins). Built in: ``stepscope`` (identity), ``vllm``,
``sglang``. A user profile is a JSON or TOML file::

    # myengine.toml
    name = "myengine"                         # shown in reports
    step_pattern = "^ProfilerStep#(\\d+)$"     # optional: ranges that envelope one step;
                                              # group 1, when present, is the step number
    step_fallback_pattern = ["run_step$", "execute_model$"]  # optional: envelopes when no
                                              # name matches step_pattern; the first pattern
                                              # that matches a name wins (a string works too)
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
    step_fallback_patterns: tuple[str, ...] = ()
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
        for pattern in (self.step_pattern, *self.step_fallback_patterns):
            try:
                re.compile(pattern) if pattern is not None else None
            except re.error as exc:
                raise ValueError(f"step pattern {pattern!r} is not a valid regex: {exc}") from None

    def map_name(self, raw: str, step_pattern: str | None | bool = True) -> tuple[str, str, int]:
        """``(canonical name, kind, step)`` for one raw name; unmapped names keep themselves.

        ``step_pattern``: the envelope regex to use (default: the profile's ``step_pattern``)."""
        step_re = self.step_pattern if step_pattern is True else step_pattern
        if isinstance(step_re, str):
            match = re.search(step_re, raw)
            if match:
                group = match.group(1) if match.groups() else None
                step = int(group) if group and group.isdigit() else -1
                return _STEP, "", step
        for rule in self.rules:
            if re.search(rule.pattern, raw):
                return rule.name, rule.kind, -1
        return raw, "", -1

    def envelope_pattern(self, names: Any) -> str | None:
        """The step envelope regex for a trace with these distinct raw names: ``step_pattern``
        when some name matches it, else the first of ``step_fallback_patterns`` that matches
        one (e.g. vLLM's engine ``step``, else ``execute_model``, when the trace has no
        ``ProfilerStep#``), else ``step_pattern``."""
        names = [str(n) for n in names]
        for pattern in (self.step_pattern, *self.step_fallback_patterns):
            if pattern is not None and any(re.search(pattern, n) for n in names):
                return pattern
        return self.step_pattern

    def apply(self, slices: pd.DataFrame) -> pd.DataFrame:
        """Rename mapped CPU/annotation slices in place of ``name``; ``raw_name`` keeps the original.

        ``name`` and ``kind`` come back as plain text columns (the loader categorizes them after).

        Works per distinct name, so the cost is one dict lookup per row.
        """
        if (not self.rules and self.step_pattern is None and not self.step_fallback_patterns) or (
            slices.empty
        ):
            return slices
        target = slices["role"].isin([ROLE_CPU, ROLE_ANNOTATION]).to_numpy()
        raw = slices.loc[target, "raw_name"]
        distinct = pd.unique(raw)
        step_re = self.envelope_pattern(distinct)
        table = {r: self.map_name(r, step_re) for r in distinct}
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
# Python-stack names as torch.profiler's with_stack writes them: "<path>(<line>): <function>".
_VLLM = r"vllm/v1/"
_VLLM_RUNNER = _VLLM + r"worker/gpu_model_runner\.py\(\d+\): "
_SGL = r"sglang/srt/"
PROFILES: dict[str, Profile] = {
    "stepscope": Profile("stepscope"),
    "vllm": Profile(
        "vllm",
        rules=(
            # VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 names.
            _R(r"^core step[\w ]*: schedul", "schedule"),
            _R(r"^gpu_model_runner: preprocess$", "prepare_inputs"),
            _R(r"^gpu_model_runner: (forward|sample|draft|propose)", "launch"),
            _R(r"^gpu_model_runner: (postprocess|bookkeep)", "update_from_output"),
            _R(r"^core step[\w ]*: (update_from_output|process_output)", "update_from_output"),
            _R(
                r"^core step[\w ]*: (get_output|wait|future)", "wait_output", WaitKind.SAMPLED.value
            ),
            _R(r"^structured_output: ", "grammar_mask"),
            # Default traces (with_stack=True): function names.
            _R(_VLLM + r"core/sched/\w*scheduler\.py\(\d+\): schedule$", "schedule"),
            _R(_VLLM_RUNNER + r"(_update_states|_prepare_inputs)$", "prepare_inputs"),
            _R(
                _VLLM_RUNNER + r"_get_valid_sampled_token_count$",
                "wait_output",
                WaitKind.ACCEPTED_COUNT.value,
            ),
            _R(
                _VLLM_RUNNER + r"(_model_forward|_sample|sample_tokens|propose_draft_token_ids)$",
                "launch",
            ),
            _R(_VLLM + r"sample/(rejection_)?sampler\.py\(\d+\): forward$", "launch"),
            _R(_VLLM_RUNNER + r"_bookkeeping_sync$", "update_from_output"),
            _R(
                _VLLM + r"core/sched/\w*scheduler\.py\(\d+\): update_from_output$",
                "update_from_output",
            ),
            _R(
                _VLLM
                + r"structured_output/[\w/]*\.py\(\d+\): (grammar_bitmask|apply_grammar_bitmask)$",
                "grammar_mask",
            ),
        ),
        step_pattern=r"^ProfilerStep#(\d+)$",
        step_fallback_patterns=(
            _VLLM + r"engine/core\.py\(\d+\): (?:step|step_with_batch_queue)$",
            _VLLM_RUNNER + r"execute_model$",
        ),
    ),
    "sglang": Profile(
        "sglang",
        rules=(
            _R(_SGL + r"managers/scheduler\.py\(\d+\): get_next_batch_to_run$", "schedule"),
            _R(
                _SGL + r"managers/schedule_batch\.py\(\d+\): "
                r"(prepare_for_extend|prepare_for_decode|get_model_worker_batch)$",
                "prepare_inputs",
            ),
            _R(_SGL + r"model_executor/forward_batch_info\.py\(\d+\): init_new$", "prepare_inputs"),
            _R(_SGL + r"managers/scheduler\.py\(\d+\): run_batch$", "launch"),
            _R(_SGL + r"managers/tp_worker\w*\.py\(\d+\): forward_batch_generation$", "launch"),
            _R(
                _SGL
                + r"managers/scheduler\w*\.py\(\d+\): process_batch_result(_decode|_prefill)?$",
                "update_from_output",
            ),
            _R(
                _SGL + r"managers/\w+\.py\(\d+\): resolve_(last_)?batch_result$",
                "wait_output",
                WaitKind.SAMPLED.value,
            ),
            # Only the grammar backend's mask work: sampling_batch_info's update_regex_vocab_mask
            # runs every step, grammar or not.
            _R(
                _SGL + r"constrained/\w+\.py\(\d+\): "
                r"(allocate_vocab_mask|fill_vocab_mask|move_vocab_mask|apply_vocab_mask)$",
                "grammar_mask",
            ),
        ),
        step_pattern=r"^ProfilerStep#(\d+)$",
    ),
}


def _patterns(value: Any) -> tuple[str, ...]:
    """A string or a list of strings, as a tuple."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"step_fallback_pattern must be a string or a list of strings, got {value!r}")


def _from_mapping(raw: dict[str, Any], source: str) -> Profile:
    known = {"name", "rules", "step_pattern", "step_fallback_pattern", "ineffective_overlap"}
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
            step_fallback_patterns=_patterns(raw.get("step_fallback_pattern", ())),
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
