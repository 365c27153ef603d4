"""What the scheduler holds, and how a request leaves it: the base its parts share.

The Scheduler is assembled from parts, each a class over this state: step_planning.py (one
step's token budget and chunking), preemption.py (making room), step_answer.py and forking.py
(taking a step's sampled tokens, n > 1 samples), scheduler.py (requests in and out).

Who the workers hold: every request that went out as NewRequestData and has not been dropped since
(finished_req_ids / preempted_req_ids). A running request the workers do not hold (a sample just
forked, or one whose block table copy-on-write changed) goes out whole as NewRequestData, a held
one as a CachedRequestData entry.
"""

from __future__ import annotations

from typing import ClassVar

from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.outputs import EngineCoreOutputs, SchedulerOutput
from raypaged.core.request import FinishReason, Request, RequestStatus
from raypaged.core.request_queue import make_request_queue
from raypaged.core.scheduler_config import SchedulerConfig

__all__ = ["SchedulerState"]


class SchedulerState:
    """The scheduler's requests, queues and bookkeeping of what the workers hold; _finish ends a
    request. Built only as a part of Scheduler (or AsyncScheduler)."""

    async_scheduling: ClassVar[bool] = False  # the config.async_scheduling this class implements

    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerInterface | None = None) -> None:
        if config.async_scheduling != self.async_scheduling:
            raise ValueError(f"{type(self).__name__} does not schedule with async_scheduling="
                             f"{config.async_scheduling}: build it with make_scheduler(config)")
        self.config = config
        if kv_cache_manager is None:
            kv_cache_manager = KVCacheManager(config.num_blocks, config.block_size,
                                              config.enable_prefix_caching, config.prefix_caching_hash_algo)
        elif kv_cache_manager.block_size != config.block_size:
            raise ValueError(f"the KV cache manager's block_size ({kv_cache_manager.block_size}) "
                             f"differs from the config's ({config.block_size})")
        self.kv_cache_manager = kv_cache_manager
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self._groups: dict[str, set[str]] = {}  # group id -> ids of its unfinished samples
        self._on_workers: set[str] = set()
        self._finished_req_ids: set[str] = set()  # dropped since the last schedule()
        self._pending_outputs = EngineCoreOutputs()  # finished inside schedule()
        # Running request id -> slots in its block table, from what allocate_slots returned: while
        # a step fits, the scheduler need not ask the manager. -1 forces the next step through
        # allocate_slots (after a fork: copy-on-write, or a copying manager's new table).
        self._num_slots: dict[str, int] = {}
        self._last_output: SchedulerOutput | None = None  # and the requests it scheduled, in order:
        self._scheduled: list[Request] = []
        self.num_preemptions = 0

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None,
                dropped_ids: set[str]) -> None:
        """End the request: free its blocks, forget it, and add its id to dropped_ids if the
        workers hold it (the caller takes it out of running or waiting)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv_cache_manager.free(request)
        request_id = request.request_id
        del self.requests[request_id]
        self._num_slots.pop(request_id, None)
        group = self._groups[request.group_id]
        group.discard(request_id)
        if not group:
            del self._groups[request.group_id]
        if request_id in self._on_workers:
            self._on_workers.discard(request_id)
            dropped_ids.add(request_id)
