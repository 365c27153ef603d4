"""The scheduling policy: the waiting queue's order and whom preemption takes, one class per policy.

fcfs: arrival order, and a preempted request goes back to the front (it was running before
everything still waiting); the newest running request is preempted, and a waiting request never
preempts. priority: lowest (priority, arrival_time) first; a preempted request simply re-enters
at its own key; the lowest-priority running request is preempted (newest among equals), also to
make room for a waiting request that outranks it.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

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

    @abstractmethod
    def preemption_victim(self, running: list[Request]) -> int:
        """Index in `running` (not empty) of the request to preempt when room is needed."""

    @abstractmethod
    def outranks_running(self, request: Request, running: list[Request]) -> bool:
        """May the waiting `request` preempt preemption_victim(running) to be scheduled?"""


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

    def preemption_victim(self, running: list[Request]) -> int:
        return len(running) - 1

    def outranks_running(self, request: Request, running: list[Request]) -> bool:
        return False


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

    def preemption_victim(self, running: list[Request]) -> int:
        return max(range(len(running)), key=lambda k: (running[k].priority, running[k].arrival_time, k))

    def outranks_running(self, request: Request, running: list[Request]) -> bool:
        if not running:
            return False
        victim = running[self.preemption_victim(running)]
        return (request.priority, request.arrival_time) < (victim.priority, victim.arrival_time)


def make_request_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
