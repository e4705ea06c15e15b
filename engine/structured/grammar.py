"""Grammars for structured output: what a request asks for, compiling it, and its matcher state.

* :class:`StructuredSpec` -- a workload's ``structured`` field (``{"json_schema": {...}}``,
  ``{"regex": "..."}`` or ``{"choice": [...]}``), validated.
* :class:`GrammarCompiler` -- compiles specs through xgrammar for one tokenizer and vocab; xgrammar
  is imported only when the first structured request arrives, so the engine runs without it.
* :class:`RequestGrammar` -- one request's matcher: accepts committed tokens, fills its bitmask
  rows, walking the step's drafts (then rolling back) so each draft position gets its own row.

A JSON schema compiles without free whitespace (``", "`` and ``": "`` separators, as ``json.dumps``
writes), so a small model cannot wander into endless blanks. A choice list is an EBNF
alternation of its literals (the output is one of the strings, unquoted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "StructuredSpec",
    "GrammarCompiler",
    "GrammarError",
    "RequestGrammar",
    "STRUCTURED_KINDS",
]

STRUCTURED_KINDS = ("json_schema", "regex", "choice")


class GrammarError(ValueError):
    """A structured request that cannot be served: bad spec, no tokenizer, no xgrammar."""


@dataclass(frozen=True)
class StructuredSpec:
    """One of ``json_schema`` (a dict), ``regex`` (a string) or ``choice`` (non-empty strings)."""

    kind: str
    value: Any

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise GrammarError(
                f"structured kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if self.kind == "json_schema" and not isinstance(self.value, (dict, bool)):
            raise GrammarError("json_schema must be a JSON object")
        if self.kind == "regex" and (not isinstance(self.value, str) or not self.value):
            raise GrammarError("regex must be a non-empty string")
        if self.kind == "choice":
            if not isinstance(self.value, (list, tuple)) or not self.value:
                raise GrammarError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.value):
                raise GrammarError("every choice must be a non-empty string")
            object.__setattr__(self, "value", tuple(self.value))

    @classmethod
    def from_dict(cls, obj: Any) -> StructuredSpec:
        """Parse a workload's ``structured`` field: exactly one key of :data:`STRUCTURED_KINDS`."""
        if not isinstance(obj, dict) or len(obj) != 1:
            raise GrammarError(
                f"structured must be an object with exactly one of {STRUCTURED_KINDS}, got {obj!r}"
            )
        ((kind, value),) = obj.items()
        return cls(kind, value)

    @property
    def cache_key(self) -> str:
        return self.kind + ":" + json.dumps(self.value, sort_keys=True)


def _import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise GrammarError(
            "structured output needs xgrammar: pip install 'stepscope[structured]'"
        ) from err
    return xgrammar


class GrammarCompiler:
    """Compiles :class:`StructuredSpec` s for one tokenizer; caches by spec.

    Args:
        tokenizer: a Hugging Face tokenizer (``LLM.tokenizer``).
        vocab_size: the model's vocab (rows of the bitmask cover it; ids past the tokenizer's
            vocab are never allowed).
        stop_token_ids: the model's EOS ids; the grammar allows them once it may end.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        if tokenizer is None:
            raise GrammarError("structured output needs a tokenizer; this model has none")
        xgr = _import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: dict[str, Any] = {}

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar; raises :class:`GrammarError` with xgrammar's reason."""
        key = spec.cache_key
        if key not in self._cache:
            try:
                self._cache[key] = self._compile(spec)
            except (RuntimeError, ValueError, TypeError) as err:
                reason = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                raise GrammarError(f"invalid {spec.kind}: {reason}") from None
        return self._cache[key]

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec.value), any_whitespace=False)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.value)
        return c.compile_grammar("root ::= " + alternatives)

    def matcher(self, spec: StructuredSpec) -> RequestGrammar:
        """A fresh matcher for one request."""
        return RequestGrammar(self._xgr.GrammarMatcher(self.compile(spec)), self.stop_token_ids)


class RequestGrammar:
    """One request's grammar state, advanced only by committed tokens."""

    def __init__(self, matcher: Any, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = list(stop_token_ids)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token."""
        return bool(self._matcher.is_terminated())

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance by committed tokens; False if one is not allowed (its state is then kept).

        After termination only stop tokens follow (a request with ``ignore_eos`` or ``min_tokens``
        goes on emitting EOS); they leave the state as it is.
        """
        for token_id in token_ids:
            if self._matcher.is_terminated():
                if token_id not in self._stop_token_ids:
                    return False
                continue
            if not self._matcher.accept_token(int(token_id)):
                return False
        return True

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> int:
        """Fill rows ``first_row .. first_row + len(drafts)``: row ``j`` is the mask after drafts
        ``d_1 .. d_j``. Returns how many leading drafts the grammar allows.

        Rows after the first disallowed draft repeat the last valid row: the verify never uses
        them, because that draft has probability 0 under the previous row and is rejected there.
        bitmask: [rows, words] int32 host tensor.
        """
        self._fill(bitmask, first_row)
        walked = 0
        for draft in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(draft)):
                break
            walked += 1
            self._fill(bitmask, first_row + walked)
        last = first_row + walked
        bitmask[last + 1 : first_row + len(drafts) + 1] = bitmask[last]
        if walked:
            self._matcher.rollback(walked)
        return walked

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row] = 0
            for t in self._stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)


def _bit(shift: int) -> int:
    """``1 << shift`` as a signed int32 value (bit 31 is negative)."""
    value = 1 << shift
    return value - (1 << 32) if value >= 1 << 31 else value
