"""The frontend's handle on the central engine actor (asyncio).

One pump task per client pulls the engine's batched step outputs (one Ray call per step for all
requests, an EngineCoreOutputs batch) and fans them out to per-request queues, expanding the
batch into one EngineCoreOutput per record here, in the frontend's process; `generate` is an
async iterator over one request's outputs (every sample of an n > 1 request).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, cast

import ray

from raypaged.config import EngineConfig
from raypaged.core.errors import EngineDeadError, RequestTimeoutError
from raypaged.core.group_progress import GroupProgress
from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import Request
from raypaged.core.sample_ids import parse_sample_id, sample_id, sample_request_id
from raypaged.engine.actor import EngineActor
from raypaged.engine.interface import EngineClient

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    queue: asyncio.Queue[EngineCoreOutput | BaseException]
    progress: GroupProgress  # the engine's view: which samples have had their finishing record
    group_id: str  # the id the caller knows
    engine_id: str  # the id the engine knows (see generate)
    added: ray.ObjectRef[None] | None = None  # the add_request call, once sent


def _unwrap(error: BaseException) -> BaseException:
    """The engine's own exception (InvalidRequestError, QueueFullError, …) out of Ray's wrapper."""
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.as_instanceof_cause()  # type: ignore[no-untyped-call]  # unannotated in Ray
        inner = getattr(error, "cause", None)
        return inner if isinstance(inner, BaseException) else cause
    return error


class EngineStartTimeoutError(RuntimeError):
    """A new engine was not ready within its start-up bound (AsyncEngineClient.start); its
    actor is killed. The supervisor counts it as a failed start, as any other."""


async def _awaited(ref: ray.ObjectRef[Any]) -> Any:
    return await ref


class AsyncEngineClient(EngineClient):
    def __init__(self, actor: ray.actor.ActorHandle[EngineActor], model_info: dict[str, Any]) -> None:
        self.actor = actor
        self._model_info = model_info
        self._streams: dict[str, _Stream] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # group id -> engine id, while it streams
        self._next_engine_seq = itertools.count()
        self._dead: str | None = None
        self._gone = asyncio.Event()  # set with _dead
        self._pump_task: asyncio.Task[None] | None = None
        # The engine's load as of the last batch pulled (None until the first): the front
        # door's shedding reads it (frontend/load_shedding.py).
        self._load: EngineLoad | None = None
        # Called with each pulled batch's prefix-cache events and load (a data-parallel router's
        # feed, frontend/data_parallel.py); None: nobody listens.
        self.on_batch: Callable[[list[int], EngineLoad | None], None] | None = None

    @classmethod
    async def start(cls, config: EngineConfig, actor_name: str | None = None,
                    gpu_share: float = 1.0, scheduling_strategy: Any = None) -> AsyncEngineClient:
        """Create the engine actor (it takes a GPU itself only when it runs the model in
        process, i.e. at tensor_parallel_size 1 on a GPU cluster) and wait until it is ready.
        gpu_share: the part of that GPU it reserves (data-parallel engines sharing a card).
        scheduling_strategy: where Ray places the actor (None: Ray's default). A replacement for
        an engine on a lost node must not be pinned there: a soft node affinity falls back to
        another node once its node is gone, a hard one waits for the node forever."""
        gpus: float = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call]  # unannotated in Ray
        in_process_gpu = (not config.parallel.uses_ray_workers and config.model_settings.device != "cpu"
                          and gpus >= 1)
        options: dict[str, Any] = dict(max_concurrency=32, num_cpus=0 if not in_process_gpu else 1,
                       num_gpus=gpu_share if in_process_gpu else 0)
        if actor_name:
            options.update(name=actor_name, get_if_exists=False)
        if scheduling_strategy is not None:
            options.update(scheduling_strategy=scheduling_strategy)
        # Ray types what .remote() makes as ActorProxy, a handle or the class itself.
        actor = cast("ray.actor.ActorHandle[EngineActor]", ray.remote(EngineActor).options(**options).remote(config))
        # Bounded: an actor the cluster can never place (no room for it, or its placement group
        # never placed) would otherwise be waited for forever. The engine's own waits, for its
        # worker group's placement and start-up, end within the two settings first.
        bound_s = config.parallel.placement_timeout_s + config.parallel.ray_start_timeout_s
        try:
            info = await asyncio.wait_for(_awaited(actor.model_info.remote()), bound_s)
        except TimeoutError:
            ray.kill(actor, no_restart=True)
            raise EngineStartTimeoutError(
                f"the engine did not start within {bound_s:g} s (placement_timeout_s + "
                "ray_start_timeout_s): the cluster has no room for it, or its start-up hangs") from None
        except ray.exceptions.RayError as e:
            ray.kill(actor, no_restart=True)
            raise _unwrap(e) from None
        client = cls(actor, info)
        client.start_pump()
        return client

    def start_pump(self) -> None:
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def generate(self, request: Request,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        """Yields the request's outputs as steps produce them; aborts it in the engine if the
        caller stops iterating early (a cancelled RPC, a stop string, a deadline). timeout_s:
        past it, RequestTimeoutError is raised in place of the next output (and the request
        aborted in the engine); the outputs that came before it are still yielded first."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        group_id = request.group_id
        if group_id in self._engine_ids:
            from raypaged.core.errors import InvalidRequestError

            raise InvalidRequestError(f"request id {group_id!r} is already in use")
        # The engine knows the request by an id unique in this client ("<id>@<n>": the part after
        # the last "@" differs between any two), so a caller may reuse an id at once: the records
        # an abort of the earlier request still has on their way can never reach the new one,
        # nor can the engine still hold that id.
        engine_id = f"{group_id}@{next(self._next_engine_seq)}"
        stream = _Stream(asyncio.Queue(), GroupProgress(request.sampling_params.n), group_id, engine_id)
        self._streams[engine_id] = stream
        self._engine_ids[group_id] = engine_id
        finished = False
        added = None
        expiry = None
        if timeout_s is not None:
            expiry = asyncio.get_running_loop().call_later(
                timeout_s, stream.queue.put_nowait,
                RequestTimeoutError(f"request {group_id!r} ran past its {timeout_s:g} s timeout"))
        try:
            try:
                added = stream.added = self.actor.add_request.remote(
                    dataclasses.replace(request, request_id=engine_id, group_id=engine_id))
                await added
            except ray.exceptions.RayActorError as e:
                raise EngineDeadError(f"the engine is gone: {e}") from None
            except ray.exceptions.RayTaskError as e:
                raise _unwrap(e) from None
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished and stream.progress.end(item.sample_index) and stream.progress.complete:
                    finished = True
                    return
        finally:
            if expiry is not None:
                expiry.cancel()
            self._streams.pop(engine_id, None)
            self._engine_ids.pop(group_id, None)
            if not finished and self._dead is None and added is not None:
                # Shielded: a caller cancelled again meanwhile does not stop the abort.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._abort_once_added(added, engine_id))

    async def _abort_once_added(self, added: ray.ObjectRef[None], engine_id: str) -> None:
        # The actor is threaded: an abort sent while the add is still on its way could run first,
        # find nothing, and leave the request running for no one. Wait for the add (a refused
        # one leaves nothing to abort).
        with contextlib.suppress(Exception):
            await added
            await self.actor.abort.remote([engine_id])

    async def abort(self, request_id: str) -> None:
        """Abort by the id the caller knows: a group id (every sample), or sample_id(group, i)
        (that sample). An id that is not streaming here is ignored: it finished already."""
        owner, index = parse_sample_id(request_id)
        if request_id in self._engine_ids:
            engine_id = target = self._engine_ids[request_id]
        elif index is not None and owner in self._engine_ids:
            engine_id = self._engine_ids[owner]
            target = sample_id(engine_id, index)
        else:
            return
        stream = self._streams.get(engine_id)
        if stream is None or stream.added is None:
            return  # not sent yet: nothing in the engine to abort
        # As in _abort_once_added: an abort that overtook its add would find nothing.
        with contextlib.suppress(Exception):
            await stream.added
        await self.actor.abort.remote([target])

    async def _pump(self) -> None:
        while True:
            try:
                outputs = await self.actor.get_outputs.remote()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor died or its loop did
                self._fail_all(f"the engine is gone: {_unwrap(e)}")
                return
            if outputs.load is not None:
                self._load = outputs.load
            if self.on_batch is not None:
                self.on_batch(outputs.cache_events, outputs.load)
            for out in outputs:
                stream = self._streams.get(out.group_id)
                if stream is not None:  # else: a request that ended here already
                    # Back to the caller's ids.
                    out.req_id = sample_request_id(stream.group_id, out.sample_index)
                    out.group_id = stream.group_id
                    stream.queue.put_nowait(out)

    def _fail_all(self, message: str) -> None:
        logger.error(message)
        self._dead = message
        self._gone.set()
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(message))

    async def stats(self) -> dict[str, Any]:
        """The engine's scheduler stats (engine/actor.py EngineActor.stats)."""
        stats: dict[str, Any] = await self.actor.stats.remote()
        return stats

    @property
    def model_info(self) -> dict[str, Any]:
        return self._model_info

    @property
    def load(self) -> EngineLoad | None:
        return self._load

    @property
    def is_alive(self) -> bool:
        return self._dead is None

    async def wait_dead(self) -> str:
        """Returns, with the reason, once the engine is gone (its actor died, its loop died, or
        it gave up on its workers)."""
        await self._gone.wait()
        return self._dead or "the engine is gone"

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop the engine and its workers; an engine that does not stop within timeout_s (or is
        dead already) is killed, and its workers' placement group removed."""
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump_task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.actor.shutdown.remote(), timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._remove_worker_placement_group()

    def _remove_worker_placement_group(self) -> None:
        """An engine actor that died without shutting down leaves its workers' placement group
        behind (Ray ties it to the job, not the actor), holding their GPUs: remove it."""
        from raypaged.executor.placement import worker_placement_group_name

        name = worker_placement_group_name(self.actor._actor_id.hex())
        try:
            group = ray.util.get_placement_group(name)
        except ValueError:  # none left: the engine shut down cleanly, or never made one
            return
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(group)
