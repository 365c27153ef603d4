"""The scheduler's waiting queue, one class per policy.

fcfs: arrival order, and a preempted request goes back to the front (it was running before
everything still waiting). priority: lowest (priority, arrival_time) first; a preempted request
simply re-enters at its own key.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
import itertools
from collections import deque
from typing import Iterator

from raypaged.core.request import Request


class RequestQueue(ABC):
    """The interface the scheduler uses; FCFSQueue and PriorityQueue implement it."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()  # ties on (priority, arrival): insertion order

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def make_request_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
