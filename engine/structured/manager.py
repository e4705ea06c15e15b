"""The engine's structured-output book: one grammar per live structured request, on the CPU.

Owned by :class:`engine.core.EngineCore`. Grammar state follows *committed* tokens only (what
``update_from_output`` returned), so the mask for step N+1 exists only once output N is back:
that is why sampling of a structured step is deferred under async scheduling (docs/design.md §2.9).

Row layout of a step's bitmask is the runner's logits layout: requests in the order of
``SchedulerOutput.num_scheduled_tokens``, ``1 + len(drafts)`` rows each. Rows of free requests
(and of structured requests that finished while the step was in flight) allow every token.

Speculative decoding: the drafts of step N+1 live on the device, so the runner copies them back
with output N (:meth:`note_drafts`). The mask then has one row per draft position, built by
walking the drafts through the matcher and rolling back (a verify-time bitmask): a disallowed draft
has probability 0 under its row, so verify rejects it, and with it every draft after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.kernels.bitmask import num_bitmask_words
from engine.scheduler.outputs import SchedulerOutput
from engine.structured.grammar import GrammarCompiler, GrammarError, RequestGrammar, StructuredSpec

__all__ = ["StructuredOutputManager"]

HostAlloc = Callable[[Sequence[int], torch.dtype], torch.Tensor]


class StructuredOutputManager:
    """Per-request grammars, the latest drafts, and bitmask building for a step.

    Args:
        tokenizer: the model's tokenizer (None: every structured request fails with a reason).
        vocab_size: the model's vocab size (bitmask width).
        stop_token_ids: the model's EOS ids.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.num_words = num_bitmask_words(vocab_size)
        self._stop_token_ids = tuple(stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._grammars: dict[str, RequestGrammar] = {}
        self._drafts: dict[str, list[int]] = {}
        self.num_drafts_checked = 0
        self.num_drafts_disallowed = 0

    @property
    def active(self) -> bool:
        """True while any structured request is live."""
        return bool(self._grammars)

    def add(self, req_id: str, structured: Any) -> str | None:
        """Compile and start a request's grammar; returns an error message instead of raising."""
        try:
            spec = (
                structured
                if isinstance(structured, StructuredSpec)
                else StructuredSpec.from_dict(structured)
            )
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer, self.vocab_size, self._stop_token_ids
                )
            self._grammars[req_id] = self._compiler.matcher(spec)
        except GrammarError as err:
            return f"structured output rejected: {err}"
        return None

    def remove(self, req_id: str) -> None:
        """Forget a finished or aborted request (unknown ids are ignored)."""
        self._grammars.pop(req_id, None)
        self._drafts.pop(req_id, None)

    def is_structured(self, req_id: str) -> bool:
        return req_id in self._grammars

    def needs_mask(self, so: SchedulerOutput) -> bool:
        """Does the step hold a structured request (so its sampling needs a bitmask)?"""
        return bool(self._grammars) and any(r in self._grammars for r in so.num_scheduled_tokens)

    def accept(self, req_id: str, token_ids: Sequence[int]) -> bool:
        """Advance a request's grammar by its committed tokens; False if one is disallowed."""
        grammar = self._grammars.get(req_id)
        return grammar is None or grammar.accept(token_ids)

    def note_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The drafts each request's next step will verify (copied back with the last output)."""
        for req_id, ids in drafts.items():
            if req_id in self._grammars:
                self._drafts[req_id] = ids

    def build_bitmask(self, so: SchedulerOutput, host_empty: HostAlloc) -> torch.Tensor:
        """The step's bitmask ``[num_logits, ceil(V / 32)]`` int32 in a host buffer."""
        spec_tokens = so.scheduled_spec_decode_tokens
        num_logits = sum(1 + len(spec_tokens.get(r, ())) for r in so.num_scheduled_tokens)
        bitmask = host_empty((num_logits, self.num_words), torch.int32)
        bitmask.fill_(-1)
        row = 0
        for req_id in so.num_scheduled_tokens:
            num_drafts = len(spec_tokens.get(req_id, ()))
            grammar = self._grammars.get(req_id)
            if grammar is not None:
                drafts = self._drafts_for(req_id, num_drafts)
                walked = grammar.fill_rows(bitmask, row, drafts)
                self.num_drafts_checked += len(drafts)
                self.num_drafts_disallowed += len(drafts) - walked
            row += 1 + num_drafts
        return bitmask

    def _drafts_for(self, req_id: str, num_drafts: int) -> list[int]:
        if num_drafts == 0:
            return []
        drafts = self._drafts.get(req_id)
        if drafts is None or len(drafts) < num_drafts:
            raise RuntimeError(
                f"request {req_id!r}: {num_drafts} drafts scheduled but the host holds "
                f"{0 if drafts is None else len(drafts)} (drafts must come back with the output)"
            )
        return drafts[:num_drafts]
