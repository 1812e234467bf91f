"""The scheduler's waiting queue, one class for both policies.

Host side, no jax. FCFS keeps arrival order and puts preempted requests back at the front;
priority orders by (priority, arrival_time): lower priority value first, then earlier arrival.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from jaxserve.core.request import Request


class WaitingQueue:
    """FCFS: a deque, preempted requests re-enter at the front. Priority: a heap on
    (priority, arrival_time), so a preempted request also re-enters ahead of later arrivals."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq),
                                        request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap)) if self.policy == "priority" \
            else iter(self._fifo)
