"""One update's per-request outputs, with the steady decode step's share kept as columns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from engine.scheduler.request_output import RequestOutput

__all__ = ["StepOutputs"]


class StepOutputs(Sequence[RequestOutput]):
    """A ``Sequence[RequestOutput]`` in the step's request order, built lazily.

    Most requests of a steady decode step commit one token and go on running; for those the
    scheduler keeps only columns (``plain_req_ids``, ``plain_token_ids``): no ``RequestOutput``
    and no one-token list per request per step unless someone iterates or indexes. The other
    outputs (finished requests, drafts, logprobs, prefill chunks) are ``explicit``. A consumer
    that only needs tokens and finishes reads the columns and ``explicit`` directly (the
    engine's request timeline and the offline driver do); everything else sees the same
    ``RequestOutput`` objects, in the same order, as a list would hold.
    """

    __slots__ = (
        "explicit",
        "_explicit_rows",
        "plain_req_ids",
        "plain_token_ids",
        "_plain_rows",
        "_plain_num_cached",
        "_list",
    )

    def __init__(
        self,
        explicit: list[RequestOutput],
        explicit_rows: list[int],
        plain_req_ids: list[str],
        plain_token_ids: list[int],
        plain_rows: list[int],
        plain_num_cached: np.ndarray,
    ) -> None:
        """``*_rows``: each output's position among the step's requests (orders the merge)."""
        self.explicit = explicit
        self._explicit_rows = explicit_rows
        self.plain_req_ids = plain_req_ids  # one committed token each, still running
        self.plain_token_ids = plain_token_ids
        self._plain_rows = plain_rows
        self._plain_num_cached = plain_num_cached
        self._list: list[RequestOutput] | None = None

    def _materialise(self) -> list[RequestOutput]:
        if self._list is None:
            by_row: list[tuple[int, RequestOutput]] = list(
                zip(self._explicit_rows, self.explicit, strict=True)
            )
            by_row += [
                (row, RequestOutput(req_id, [token_id], False, None, None, 0, 0, num_cached))
                for row, req_id, token_id, num_cached in zip(
                    self._plain_rows,
                    self.plain_req_ids,
                    self.plain_token_ids,
                    self._plain_num_cached.tolist(),
                    strict=True,
                )
            ]
            by_row.sort(key=lambda item: item[0])
            self._list = [output for _, output in by_row]
        return self._list

    def __len__(self) -> int:
        return len(self.explicit) + len(self.plain_req_ids)

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self._materialise())

    @overload
    def __getitem__(self, index: int) -> RequestOutput: ...

    @overload
    def __getitem__(self, index: slice) -> list[RequestOutput]: ...

    def __getitem__(self, index: int | slice) -> RequestOutput | list[RequestOutput]:
        return self._materialise()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepOutputs | list | tuple):
            return self._materialise() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepOutputs({self._materialise()!r})"
