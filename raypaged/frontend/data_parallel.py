"""Data parallelism: N engine replicas (each its own engine actor, TP group, placement group and
KV pool) behind one frontend, with the router of frontend/prefix_router.py choosing per request.

`DataParallelEngineClient` is what the frontend's GenerationService drives in place of one
AsyncEngineClient (the same generate / abort / load / is_alive / wait_dead / stats / shutdown).
It hashes each prompt's full blocks with core's own chain (the engines' `sha256` chain means the
same here), asks the router, and streams from the replica it names; every batch a replica's
pump pulls feeds the router that replica's cache events and load.

A replica that dies: the router stops sending there at once and its streams move to another
replica, as frontend/replay.py carries streams over to a restarted engine (the same
StreamJournal): a request that has streamed nothing yet starts again there; otherwise each open
sample is resumed alone with the tokens it has streamed (recomputed), n > 1 samples as requests
of their own with the seed each had after the fork, so greedy and seeded outputs are a fault-free
run's; samples the caller ended are not resumed. With a factory the dead replica is then replaced
(frontend/supervisor.py's backoff) and rejoins with an empty cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from raypaged.core.block_hashing import block_hasher, prefix_hash_values
from raypaged.core.errors import EngineDeadError, InvalidRequestError
from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import ENGINE_FAILED, Request
from raypaged.core.scheduler import SchedulerStats
from raypaged.engine.client import AsyncEngineClient
from raypaged.engine.interface import EngineClient
from raypaged.frontend.prefix_router import NoReplicaError, PrefixRouter
from raypaged.frontend.replay import run_journal
from raypaged.frontend.router_metrics import RouterMetrics, merge_stats
from raypaged.frontend.stream_journal import StreamJournal, journal_of
from raypaged.frontend.supervisor import EngineSupervisor, RestartPolicy

logger = logging.getLogger(__name__)

ReplicaFactory = Callable[[], Awaitable[AsyncEngineClient]]


class DataParallelEngineClient(EngineClient):
    def __init__(self, replicas: list[AsyncEngineClient], policy: str = "prefix",
                 factory: ReplicaFactory | None = None,
                 restart_policy: RestartPolicy | None = None) -> None:
        """replicas: started engine clients of one model and block size. factory: how to start a
        replacement for a dead replica (None: it stays dead)."""
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        info = replicas[0].model_info
        self.block_size: int = info["block_size"]
        self.prefix_caching: bool = info.get("enable_prefix_caching", True)
        algo = info.get("prefix_caching_hash_algo", "sha256")
        if len(replicas) > 1 and self.prefix_caching and algo != "sha256":
            raise ValueError("data parallelism routes by the engines' block hashes: they must be "
                             f"sha256 (the same in every process), not {algo!r}")
        self._hasher = block_hasher(algo)
        self._model_info = {**info, "data_parallel_size": len(replicas)}
        self.replicas = replicas
        self.router = PrefixRouter(len(replicas), policy)
        self.metrics: RouterMetrics | None = None
        self._factory = factory
        self._supervisors = [EngineSupervisor(factory, restart_policy or RestartPolicy()) if factory else None
                             for _ in replicas]
        self._journals: dict[str, StreamJournal] = {}  # by group id: what each stream handed on
        self._owners: dict[str, int] = {}  # group id -> the replica streaming it now
        self._restarts: set[asyncio.Task[None]] = set()
        self._all_dead = asyncio.Event()
        for index, client in enumerate(replicas):
            self._watch(index, client)

    @classmethod
    async def start(cls, num_replicas: int, factory: ReplicaFactory, policy: str = "prefix",
                    restart: bool = True) -> DataParallelEngineClient:
        """Start num_replicas engines, one after another (each sizes its KV pool from the memory
        the ones before it left)."""
        replicas: list[AsyncEngineClient] = []
        try:
            for _ in range(num_replicas):
                replicas.append(await factory())
        except BaseException:
            for client in replicas:
                await client.shutdown()
            raise
        return cls(replicas, policy, factory if restart else None)

    # ---- what GenerationService reads -------------------------------------------------------------
    @property
    def model_info(self) -> dict[str, Any]:
        return self._model_info

    @property
    def load(self) -> EngineLoad | None:
        """The live replicas' loads together (the front door sheds against the whole)."""
        loads = [s.load for s in self.router.replicas if s.alive and s.load is not None]
        if not loads:
            return None
        return EngineLoad(sum(x.num_waiting for x in loads), sum(x.num_running for x in loads),
                          sum(x.kv_usage for x in loads) / len(loads))

    @property
    def is_alive(self) -> bool:
        return any(s.alive for s in self.router.replicas)

    async def wait_dead(self) -> str:
        await self._all_dead.wait()
        return "every data-parallel replica is gone"

    def attach_metrics(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    async def stats(self) -> dict[str, Any]:
        """The live replicas' scheduler stats summed (as one engine's), and each one's for the
        per-replica metrics."""
        per_replica: dict[int, SchedulerStats] = {}
        for index, client in enumerate(self.replicas):
            if self.router.replicas[index].alive:
                with contextlib.suppress(Exception):
                    per_replica[index] = (await client.stats())["scheduler"]
        if self.metrics is not None:
            self.metrics.record(self.router, per_replica)
        if not per_replica:
            raise EngineDeadError("no live data-parallel replica")
        return {"scheduler": merge_stats(list(per_replica.values()))}

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, request: Request,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        """As AsyncEngineClient.generate, on the replica the router picks (and on another when
        that one dies, see the module's docstring)."""
        group_id = request.group_id
        if group_id in self._journals:
            raise InvalidRequestError(f"request id {group_id!r} is already in use")
        values = (prefix_hash_values(request.prompt_token_ids, self.block_size, request.cache_salt,
                                     self._hasher) if self.prefix_caching else [])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        journal = StreamJournal(request)
        self._journals[group_id] = journal
        tried: set[int] = set()
        try:
            while True:
                try:
                    route = self.router.route(values, frozenset(tried))
                except NoReplicaError:
                    raise EngineDeadError("every data-parallel replica is gone") from None
                self._owners[group_id] = route.replica
                left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    async with contextlib.aclosing(run_journal(self.replicas[route.replica], journal,
                                                               left_s)) as outputs:
                        async for out in outputs:
                            if out.stop_reason == ENGINE_FAILED and out.error is not None:
                                raise EngineDeadError(out.error)  # it gave up on its workers
                            journal.note(out)
                            yield out
                    return
                except EngineDeadError:
                    # This replica is gone (its pump may notice a moment later than this stream).
                    tried.add(route.replica)
                    logger.warning("request %r: replica %d died, going on on another (samples %s)",
                                   group_id, route.replica, journal.open_indices)
                finally:
                    self.router.finished(route)
                for out in journal.ends_owed():  # samples the caller ended as the replica died
                    journal.note(out)
                    yield out
                if journal.complete:
                    return
        finally:
            del self._journals[group_id]
            self._owners.pop(group_id, None)

    async def abort(self, request_id: str) -> None:
        journal = journal_of(self._journals, request_id)
        if journal is None:
            return
        replica = self._owners.get(journal.group_id)
        for target in journal.abort(request_id):
            if replica is not None:
                # A dead replica holds nothing to abort, and the closed samples are not resumed.
                with contextlib.suppress(Exception):
                    await self.replicas[replica].abort(target)

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        for task in list(self._restarts):
            task.cancel()
        for task in list(self._restarts):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(client.shutdown(timeout_s) for client in self.replicas),
                             return_exceptions=True)

    # ---- replicas ---------------------------------------------------------------------------------
    def _watch(self, index: int, client: AsyncEngineClient) -> None:
        router = self.router

        def on_batch(events: list[int], load: EngineLoad | None) -> None:
            if self.replicas[index] is client:
                if events:
                    router.apply_events(index, events)
                if load is not None:
                    router.update_load(index, load)

        client.on_batch = on_batch
        task = asyncio.get_running_loop().create_task(self._on_death(index, client))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _on_death(self, index: int, client: AsyncEngineClient) -> None:
        reason = await client.wait_dead()
        logger.error("data-parallel replica %d: %s", index, reason)
        self.router.mark_dead(index)
        supervisor = self._supervisors[index]
        if supervisor is None:
            if not self.is_alive:
                self._all_dead.set()
            return
        replacement = await supervisor.replace(client)
        if replacement is None:
            if not self.is_alive:
                self._all_dead.set()
            return
        self.replicas[index] = replacement
        self.router.mark_alive(index)
        self._watch(index, replacement)
        logger.info("data-parallel replica %d replaced", index)


# What the frontend's service and server drive: one engine, or data-parallel replicas.
EngineHandle = AsyncEngineClient | DataParallelEngineClient
