"""Workloads: JSONL with vLLM's sampling-parameter names, ShareGPT JSON, and synthetic.

Every loader returns a list of :class:`WorkloadRequest`, sorted by arrival time. A malformed line
is a :class:`WorkloadError` naming the file, the line and the field; nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from engine.fields import FieldError, check_number, check_token_ids
from engine.sampling_params import SamplingParams

__all__ = [
    "WorkloadError",
    "WorkloadRequest",
    "SyntheticSpec",
    "load_workload",
    "load_jsonl",
    "load_sharegpt",
    "synthetic_workload",
]

_PARAM_NAMES = {f.name for f in fields(SamplingParams)}
_REQUEST_KEYS = {
    "id",
    "prompt",
    "prompt_token_ids",
    "arrival_time_s",
    "structured",
    "abort_after_s",
}


class WorkloadError(ValueError):
    """A workload file or spec that cannot be run, with where and why."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: a prompt (text or token ids), its parameters and arrival."""

    id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    params: SamplingParams
    arrival_time_s: float = 0.0
    structured: dict[str, Any] | None = None  # {"json_schema"|"regex"|"choice": ...}
    abort_after_s: float | None = None  # abort this long after arrival (tests, fault drills)

    def __post_init__(self) -> None:
        where = f"request {self.id!r}"
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise WorkloadError(f"{where}: give exactly one of prompt, prompt_token_ids")
        try:
            if self.prompt_token_ids is not None:
                ids = check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)
                object.__setattr__(self, "prompt_token_ids", ids)
            elif not isinstance(self.prompt, str) or not self.prompt:
                raise FieldError("prompt", f"expected a non-empty string, got {self.prompt!r:.40}")
            arrival = check_number("arrival_time_s", self.arrival_time_s, lo=0.0)
            object.__setattr__(self, "arrival_time_s", arrival)
            if self.abort_after_s is not None:
                abort = check_number("abort_after_s", self.abort_after_s, lo=0.0)
                object.__setattr__(self, "abort_after_s", abort)
            if self.structured is not None:
                _check_structured(self.structured)
        except FieldError as err:
            raise WorkloadError(f"{where}: {err}") from None


_STRUCTURED_KINDS = ("json_schema", "regex", "choice")


def _check_structured(obj: Any) -> None:
    """The shape of ``structured`` (the grammar itself is compiled, and may fail, on arrival)."""
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in _STRUCTURED_KINDS:
        raise FieldError(
            "structured", f"expected an object with exactly one of {list(_STRUCTURED_KINDS)}"
        )
    ((kind, value),) = obj.items()
    ok = {
        "regex": isinstance(value, str),
        "choice": isinstance(value, list)
        and bool(value)
        and all(isinstance(c, str) for c in value),
        "json_schema": isinstance(value, dict | str | bool),
    }[kind]
    if not ok:
        wanted = {
            "regex": "a string",
            "choice": "a non-empty list of strings",
            "json_schema": "a JSON schema object",
        }[kind]
        raise FieldError(f"structured.{kind}", f"expected {wanted}, got {value!r:.40}")


def _request_from_dict(obj: Any, where: str, index: int) -> WorkloadRequest:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _PARAM_NAMES - _REQUEST_KEYS
    if unknown:
        raise WorkloadError(f"{where}: unknown field(s) {sorted(unknown)}")
    params = {k: v for k, v in obj.items() if k in _PARAM_NAMES}
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    if isinstance(prompt, list) and ids is None:  # vLLM: a prompt may be token ids
        prompt, ids = None, prompt
    req_id = obj.get("id", index)
    try:
        if isinstance(req_id, bool) or not isinstance(req_id, str | int):
            raise FieldError("id", f"expected a string or an integer, got {req_id!r:.40}")
        sampling = SamplingParams(**params)
        request = WorkloadRequest(
            id=str(req_id),
            prompt=prompt,
            prompt_token_ids=ids,
            params=sampling,
            arrival_time_s=obj.get("arrival_time_s", 0.0),
            structured=obj.get("structured"),
            abort_after_s=obj.get("abort_after_s"),
        )
    except FieldError as err:
        raise WorkloadError(f"{where}: {err}") from None
    except WorkloadError as err:  # already names the request; give the line instead
        raise WorkloadError(f"{where}: {str(err).split(': ', 1)[-1]}") from None
    return request


def _read_text(path: str) -> str:
    """The file as text; a byte that is not UTF-8 names the line and column."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        byte = data[err.start]
        raise WorkloadError(
            f"{path}:{lineno}: not UTF-8 (byte 0x{byte:02x} at column {column})"
        ) from None


def load_jsonl(path: str) -> list[WorkloadRequest]:
    """One JSON object per line: ``id``, ``prompt`` (text or token ids) or ``prompt_token_ids``,
    vLLM's parameter names (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs``,
    ``skip_special_tokens``, ...), ``arrival_time_s``, ``abort_after_s``, ``structured``.
    Types and ranges are vLLM's (engine/fields.py); NaN and Infinity are refused."""
    requests: list[WorkloadRequest] = []
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line, parse_constant=_refuse_constant)
        except json.JSONDecodeError as err:
            raise WorkloadError(f"{where}: not JSON ({err.msg})") from None
        except _NonFinite as err:
            raise WorkloadError(f"{where}: {err} is not a number JSON allows") from None
        requests.append(_request_from_dict(obj, where, len(requests)))
    return _checked(requests, path)


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    """``json`` accepts NaN, Infinity and -Infinity by default; a workload may not hold them."""
    raise _NonFinite(name)


def load_sharegpt(
    path: str, max_tokens: int = 128, limit: int | None = None
) -> list[WorkloadRequest]:
    """ShareGPT JSON: a list of ``{"id", "conversations": [{"from": "human", "value": ...}, ...]}``;
    the first human turn is the prompt, the first reply's length (in words) hints ``max_tokens``."""
    try:
        data = json.loads(_read_text(path), parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None
    except _NonFinite as err:
        raise WorkloadError(f"{path}: {err} is not a number JSON allows") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: ShareGPT data must be a JSON list")
    requests = []
    for i, item in enumerate(data):
        turns = _sharegpt_turns(item, f"{path}: item {i}")
        if not turns:
            continue
        human = next((v for who, v in turns if who in ("human", "user")), None)
        reply = next((v for who, v in turns if who in ("gpt", "assistant")), "")
        if not human:
            continue
        out_len = max(1, min(max_tokens, len(reply.split()) or max_tokens))
        item_id = item.get("id", i)
        requests.append(
            WorkloadRequest(
                str(item_id),
                human,
                None,
                SamplingParams(temperature=0.0, max_tokens=out_len),
            )
        )
        if limit is not None and len(requests) >= limit:
            break
    return _checked(requests, path)


def _sharegpt_turns(item: Any, where: str) -> list[tuple[str, str]]:
    """An item's ``conversations`` as (from, value) pairs; a malformed one names the field."""
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: expected an object, got {type(item).__name__}")
    item_id = item.get("id")
    if item_id is not None and (isinstance(item_id, bool) or not isinstance(item_id, str | int)):
        raise WorkloadError(f"{where}: id: expected a string or an integer, got {item_id!r:.40}")
    turns = item.get("conversations")
    if turns is None:
        return []
    if not isinstance(turns, list):
        raise WorkloadError(f"{where}: conversations: expected a list of turns")
    pairs = []
    for j, turn in enumerate(turns):
        ok = (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        )
        if not ok:
            raise WorkloadError(
                f"{where}: conversations[{j}]: expected an object with string 'from' and "
                f"'value', got {turn!r:.40}"
            )
        pairs.append((turn["from"], turn["value"]))
    return pairs


@dataclass(frozen=True)
class SyntheticSpec:
    """Random prompts of token ids: lengths from uniform ranges, Poisson arrivals or all at once."""

    num_requests: int = 32
    input_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 64)
    request_rate: float | None = None  # requests/s, Poisson; None = all at t=0
    vocab_size: int = 1000
    shared_prefix_len: int = 0
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise WorkloadError("num_requests must be >= 1")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise WorkloadError(f"{name} must satisfy 1 <= min <= max, got {(lo, hi)}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise WorkloadError("request_rate must be > 0 (or None for all at once)")
        if self.vocab_size < 2:
            raise WorkloadError("vocab_size must be >= 2")


def synthetic_workload(spec: SyntheticSpec) -> list[WorkloadRequest]:
    import numpy as np  # here, so that `stepscope run --help` imports neither numpy nor torch

    rng = np.random.default_rng(spec.seed)
    prefix = rng.integers(0, spec.vocab_size, spec.shared_prefix_len).tolist()
    t = 0.0
    requests = []
    for i in range(spec.num_requests):
        n_in = int(rng.integers(spec.input_len[0], spec.input_len[1] + 1))
        n_out = int(rng.integers(spec.output_len[0], spec.output_len[1] + 1))
        ids = prefix + rng.integers(0, spec.vocab_size, n_in).tolist()
        if spec.request_rate is not None:
            t += float(rng.exponential(1.0 / spec.request_rate))
        params = SamplingParams(
            temperature=spec.temperature,
            max_tokens=n_out,
            ignore_eos=True,
            seed=spec.seed * 100_003 + i,
        )
        requests.append(WorkloadRequest(f"syn-{i}", None, tuple(ids), params, t))
    return requests


def parse_synthetic(text: str) -> SyntheticSpec:
    """``synthetic:n=64,in=16-64,out=16-64,rate=8,vocab=1000,prefix=0,temp=0,seed=0``."""
    body = text.split(":", 1)[1] if ":" in text else ""
    kwargs: dict[str, Any] = {}
    names = {
        "n": "num_requests",
        "in": "input_len",
        "out": "output_len",
        "rate": "request_rate",
        "vocab": "vocab_size",
        "prefix": "shared_prefix_len",
        "temp": "temperature",
        "seed": "seed",
    }
    for part in filter(None, body.split(",")):
        key, _, value = part.partition("=")
        if key not in names:
            raise WorkloadError(f"synthetic spec: unknown key {key!r} (known: {sorted(names)})")
        try:
            if key in ("in", "out"):
                lo, _, hi = value.partition("-")
                kwargs[names[key]] = (int(lo), int(hi or lo))
            elif key in ("rate", "temp"):
                kwargs[names[key]] = float(value)
            else:
                kwargs[names[key]] = int(value)
        except ValueError:
            raise WorkloadError(f"synthetic spec: bad value {value!r} for {key}") from None
    return SyntheticSpec(**kwargs)


def load_workload(source: str, vocab_size: int | None = None) -> list[WorkloadRequest]:
    """Dispatch on the source: ``synthetic:...``, a ``.jsonl`` file, or ShareGPT ``.json``."""
    if source.startswith("synthetic"):
        spec = parse_synthetic(source)
        if vocab_size is not None and "vocab=" not in source:
            spec = SyntheticSpec(**{**spec.__dict__, "vocab_size": vocab_size})
        return synthetic_workload(spec)
    if not os.path.exists(source):
        raise WorkloadError(f"workload file not found: {source}")
    if source.endswith(".jsonl"):
        return load_jsonl(source)
    if source.endswith(".json"):
        return load_sharegpt(source)
    raise WorkloadError(f"{source}: expected .jsonl, ShareGPT .json, or synthetic:...")


def _checked(requests: list[WorkloadRequest], where: str) -> list[WorkloadRequest]:
    if not requests:
        raise WorkloadError(f"{where}: no requests")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise WorkloadError(f"{where}: duplicate request id {dup!r}")
    return sorted(requests, key=lambda r: r.arrival_time_s)
