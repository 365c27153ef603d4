"""ServeEnginePool: the engine deployment's replicas as one EngineClient, held by the ingress.

The ingress (serve/deployment.py) runs GenerationService over this pool: validation,
tokenization, tenants, shedding, detokenization and stop strings stay with the client's
connection, and only token-level records cross to the engine replicas
(serve/engine_deployment.py `generate`, a streaming DeploymentHandle call). Serve's request
router for that deployment (serve/prefix_request_router.py, in this process) picks each call's
replica by the prompt's cached prefix and load.

Replicas that die mid-stream: when a replica's actor dies (RayActorError), its engine dies
(EngineDeadError) or its engine gives up on its workers (an ENGINE_FAILED record), the stream
goes on on another replica as frontend/replay.py does it for a restarted engine actor, from the
same StreamJournal (frontend/stream_journal.py): the request again if nothing was streamed,
else each open sample as `Request.resumed_output_token_ids` (prompt + the tokens already
streamed, every count and the seeded sampler's positions continuing), its records renumbered as
the group's. The caller sees one continuous stream: no gap, no repeat. The lost replica is
avoided by the retry (serve/route_hint.py) even before Serve's controller notices it, and by
every new call of this process too: the loss holds it in the quarantine the router reads
(serve/replica_quarantine.py) until Serve's set drops it or it reports a live engine. Every
handle call is a Serve request of its own (serve/call_identity.py): the samples resumed at once
and an abort beside its stream would otherwise share the client request's id in Serve's router.

Bounds: a retry waits at most recovery_timeout_s for a replica to take it (every replica lost:
for Serve to bring one back), else EngineDeadError (UNAVAILABLE); a stream is resumed at most
max_resumes times (a request that kills every engine it reaches does not go round them all);
a request's own timeout runs on across replicas.

Load: the engines' loads are the router's (fed by their routing stats), not this pool's, so
`load` is None: the ingress's shedder counts its own waiting requests and tokens, and KV-usage
shedding is left to each engine's own waiting-queue bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any, cast

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from raypaged.core.errors import EngineDeadError, InvalidRequestError
from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import ENGINE_FAILED, Request
from raypaged.engine.interface import EngineClient
from raypaged.frontend.replay import as_sample, merged_runs
from raypaged.frontend.stream_journal import StreamJournal, journal_of
from raypaged.serve.call_identity import CallIdentities
from raypaged.serve.replica_quarantine import ReplicaQuarantine, process_quarantine
from raypaged.serve.route_hint import RouteHint

logger = logging.getLogger(__name__)


class ReplicaLostError(EngineDeadError):
    """The engine replica streaming a request is gone (replica: its id, None if not known)."""

    def __init__(self, replica: str | None, message: str) -> None:
        super().__init__(message)
        self.replica = replica


class ServeEnginePool(EngineClient):
    def __init__(self, handle: DeploymentHandle, model_info: dict[str, Any], recovery_timeout_s: float = 60.0,
                 max_resumes: int = 3, abort_timeout_s: float = 10.0,
                 quarantine: ReplicaQuarantine | None = None) -> None:
        """quarantine: the replicas no new call goes to, shared with the handle's router (None:
        the process's own; a test passes another)."""
        if recovery_timeout_s <= 0 or max_resumes < 0:
            raise ValueError("recovery_timeout_s must be > 0 and max_resumes >= 0")
        self._handle = handle
        self._model_info = model_info
        self.recovery_timeout_s = recovery_timeout_s
        self.max_resumes = max_resumes
        self.abort_timeout_s = abort_timeout_s
        self.num_resumed = 0  # streams that went on on another replica
        self._journals: dict[str, StreamJournal] = {}  # by group id
        self._where: dict[str, str] = {}  # engine request id -> the replica streaming it
        self._calls = CallIdentities()
        self.quarantine = quarantine or process_quarantine()

    @classmethod
    async def start(cls, handle: DeploymentHandle, **kwargs: Any) -> ServeEnginePool:
        """Asks a replica for the model's description (waits for one to be up)."""
        return cls(handle, await handle.model_info.remote(), **kwargs)

    # ---- EngineClient --------------------------------------------------------------------------
    @property
    def model_info(self) -> dict[str, Any]:
        return self._model_info

    @property
    def load(self) -> EngineLoad | None:
        return None

    @property
    def held_out(self) -> frozenset[str]:
        """The engine replicas no new call goes to now (serve/replica_quarantine.py)."""
        return self.quarantine.held()

    @property
    def is_alive(self) -> bool:
        """Serve keeps the engine deployment's replicas coming back; a stream that finds none
        within recovery_timeout_s fails then."""
        return True

    async def generate(self, request: Request,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        group_id = request.group_id
        if group_id in self._journals:
            raise InvalidRequestError(f"request id {group_id!r} is already in use")
        journal = StreamJournal(request)
        self._journals[group_id] = journal
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lost: set[str] = set()
        resumes = 0
        try:
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    async with contextlib.aclosing(self._run(journal, left, frozenset(lost))) as outputs:
                        async for out in outputs:
                            journal.note(out)
                            yield out
                    return
                except ReplicaLostError as e:
                    if e.replica is not None:
                        lost.add(e.replica)
                        self.quarantine.hold(e.replica, str(e))
                    for out in journal.ends_owed():
                        journal.note(out)
                        yield out
                    if journal.complete:
                        return
                    resumes += 1
                    if resumes > self.max_resumes:
                        raise EngineDeadError(f"request {group_id!r} lost {resumes} engine replicas; "
                                              "not resumed again") from None
                    self.num_resumed += 1
                    logger.warning("request %r lost engine replica %s (%s): going on on another (samples %s)",
                                   group_id, e.replica, str(e).splitlines()[0], journal.open_indices)
        finally:
            del self._journals[group_id]

    async def abort(self, request_id: str) -> None:
        journal = journal_of(self._journals, request_id)
        if journal is None:
            return
        per_sample = journal.per_sample
        for target in journal.abort(request_id):
            # The replica streaming it: the sample's own (resumed) request, else the group's.
            replica = self._where.get(target if per_sample else journal.request.request_id)
            if replica is None:
                continue
            # A replica that died meanwhile holds nothing to abort; the sample is not resumed.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._calls.call(target, self._handle.abort.remote, target,
                                                        route=RouteHint(pin=replica)), self.abort_timeout_s)

    # ---- streams -------------------------------------------------------------------------------
    async def _run(self, journal: StreamJournal, timeout_s: float | None,
                   avoid: frozenset[str]) -> AsyncGenerator[EngineCoreOutput, None]:
        """One attempt's records, in the group's numbering."""
        runs = journal.resumptions()

        def stream(request: Request, left: float | None) -> AsyncGenerator[EngineCoreOutput, None]:
            return self._stream(request, left, avoid)

        if len(runs) == 1:
            index, request = runs[0]
            async with contextlib.aclosing(stream(request, timeout_s)) as outputs:
                async for out in outputs:
                    yield out if index is None else as_sample(out, journal.group_id, index)
            return
        async with contextlib.aclosing(merged_runs(stream, runs, timeout_s)) as merged:
            async for index, out in merged:
                yield as_sample(out, journal.group_id, index)

    async def _stream(self, request: Request, timeout_s: float | None,
                      avoid: frozenset[str]) -> AsyncGenerator[EngineCoreOutput, None]:
        """One engine replica's stream of `request`; its loss raised as ReplicaLostError, the
        engine's own errors (InvalidRequestError, QueueFullError, RequestTimeoutError) as
        themselves. Leaving it early cancels the call, which aborts the request there."""
        key = request.request_id
        call = cast(DeploymentResponseGenerator, self._calls.call(
            key, self._handle.options(stream=True).generate.remote, request, timeout_s, route=RouteHint(avoid=avoid)))
        replica: str | None = None
        try:
            try:
                replica = await asyncio.wait_for(call.__anext__(), self.recovery_timeout_s)
            except asyncio.TimeoutError:  # not TimeoutError before 3.11
                raise EngineDeadError(f"no engine replica took the request within "
                                      f"{self.recovery_timeout_s:g} s") from None
            assert isinstance(replica, str)
            self._where[key] = replica
            async for out in call:
                if out.stop_reason == ENGINE_FAILED and out.error is not None:
                    raise ReplicaLostError(replica, out.error)  # it gave up on its workers
                yield out
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, EngineDeadError):
                raise ReplicaLostError(replica, str(cause)) from None
            if isinstance(cause, Exception):
                raise cause from None
            raise
        except (RayActorError, ActorUnavailableError) as e:
            raise ReplicaLostError(replica, f"the replica's actor is gone: {e}") from None
        finally:
            if replica is not None and self._where.get(key) == replica:
                del self._where[key]
            call.cancel()
