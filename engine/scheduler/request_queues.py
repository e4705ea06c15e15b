"""Where every live request is: waiting, running, or finished with blocks still to release."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator

from engine.request import Request, RequestStatus

__all__ = ["RequestQueues"]


class RequestQueues:
    """Membership of the scheduler's requests, and which ones the runner holds a row for.

    ``waiting`` is FIFO with preempted requests put back at the front; ``running`` is kept in
    arrival order, so its last request is the next preemption victim. A finished request stays
    tracked while a step in flight still references it (its blocks are not released yet).
    """

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._arrival_key: dict[str, tuple[float, int]] = {}
        self._num_added = 0
        self.waiting: deque[Request] = deque()  # read-only outside this class
        self.running: list[Request] = []  # read-only outside this class
        self._runner_rows: set[str] = set()
        self._rows_to_drop: set[str] = set()
        self._release_pending: set[str] = set()
        # Bumped whenever ``running`` changes (admit, preempt, finish): whatever was derived
        # from it (the running requests' slots) is still valid while this stays the same.
        self.version = 0

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())

    def get(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def get_many(self, req_ids: Iterable[str]) -> list[Request | None]:
        """``get`` of each id, in order (one C-level pass: once per step over its requests)."""
        return list(map(self._requests.get, req_ids))

    def add(self, request: Request) -> None:
        self._requests[request.req_id] = request
        self._arrival_key[request.req_id] = (request.arrival_time, self._num_added)
        self._num_added += 1
        self.waiting.append(request)

    def admit(self, request: Request) -> None:
        """The head of ``waiting`` starts running and gets a runner row."""
        assert self.waiting[0] is request, "admission is in queue order"
        self.version += 1
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        key = self._arrival_key
        bisect.insort(self.running, request, key=lambda r: key[r.req_id])
        self._runner_rows.add(request.req_id)

    def preempt(self, request: Request) -> None:
        """Back to the front of ``waiting``; the runner drops its row; blocks to be released."""
        self.version += 1
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self._drop_row(request)
        self._release_pending.add(request.req_id)

    def finish(self, request: Request) -> None:
        """Leave the queues (status already finished); the runner drops its row."""
        self.version += 1
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._drop_row(request)
        self._release_pending.add(request.req_id)

    def take_release(self, request: Request) -> bool:
        """True once the request's blocks may go back to the pool: it awaits release and no step
        in flight references it. A finished request is forgotten at that point."""
        if request.num_steps_in_flight > 0 or request.req_id not in self._release_pending:
            return False
        self._release_pending.remove(request.req_id)
        if request.is_finished:
            del self._requests[request.req_id]
            del self._arrival_key[request.req_id]
        return True

    def awaiting_release(self) -> list[Request]:
        """Requests (preempted or finished) whose blocks return once their steps settle."""
        return [self._requests[req_id] for req_id in self._release_pending]

    def take_rows_to_drop(self) -> set[str]:
        """Runner rows to free before the next step (finished or preempted since the last)."""
        rows, self._rows_to_drop = self._rows_to_drop, set()
        return rows

    def _drop_row(self, request: Request) -> None:
        if request.req_id in self._runner_rows:
            self._runner_rows.remove(request.req_id)
            self._rows_to_drop.add(request.req_id)

    def check(self, max_num_seqs: int) -> None:
        """Debug: no request lost or duplicated; queues hold the right statuses."""
        running_ids = [r.req_id for r in self.running]
        waiting_ids = [r.req_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is twice in waiting"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert len(self.running) <= max_num_seqs, "more running requests than max_num_seqs"
        finished_ids = {r.req_id for r in self._requests.values() if r.is_finished}
        assert finished_ids <= self._release_pending, "a finished request kept without a reason"
        live = set(running_ids) | set(waiting_ids) | finished_ids
        assert live == set(self._requests), f"lost or stray: {sorted(live ^ set(self._requests))}"
        assert all(r.status is RequestStatus.RUNNING for r in self.running), "bad running status"
        waiting_statuses = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert all(r.status in waiting_statuses for r in self.waiting), "bad waiting status"
