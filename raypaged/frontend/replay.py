"""ReplayingEngine: the engine as the front doors see it, whose streams outlive the engine actor.

It stands for the supervisor's current AsyncEngineClient (the server swaps a new one in,
frontend/supervisor.py). Each stream's journal (frontend/stream_journal.py) holds what it has
handed on; when its engine dies (EngineDeadError: the actor died; or the engine gave up on its
workers' restarts, and ended its requests with stop_reason ENGINE_FAILED), the stream waits for
the next engine and goes on there: the request again if nothing was streamed yet, else each
open sample resumed with its tokens. An engine that dies again meanwhile is one more outage.
The caller sees one continuous stream of records: no gap, no token twice, every record in the
group's numbering; the text side (detokenizer, stop strings) lives with the caller and goes on.

Bounds: one outage lasts at most recovery_timeout_s, from the moment the engine was found dead.
Streams and new requests wait for the new engine until then and get EngineDeadError
(UNAVAILABLE) after it, or at once when the supervisor gives up; a request's own timeout keeps
running meanwhile (RequestTimeoutError when it passes first). recovery_timeout_s 0: no replay,
streams end with the engine as before.

Not replayed: requests the engine failed for their own sake (records with another error: a
grammar that did not compile in time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from raypaged.core.errors import EngineDeadError, InvalidRequestError, QueueFullError, RequestTimeoutError
from raypaged.core.outputs import EngineCoreOutput, EngineLoad
from raypaged.core.request import ENGINE_FAILED, Request
from raypaged.core.sample_ids import sample_request_id
from raypaged.engine.client import AsyncEngineClient
from raypaged.engine.interface import EngineClient
from raypaged.frontend.stream_journal import StreamJournal, journal_of

logger = logging.getLogger(__name__)

# How one engine streams a request: EngineClient.generate's signature.
Generate = Callable[[Request, float | None], AsyncGenerator[EngineCoreOutput, None]]

_REQUEUE_S = 0.1  # how soon a replayed stream the new engine's full queue refused tries again


class ReplayingEngine(EngineClient):
    def __init__(self, engine: AsyncEngineClient, recovery_timeout_s: float = 0.0) -> None:
        if recovery_timeout_s < 0:
            raise ValueError("recovery_timeout_s must be >= 0")
        self.current = engine
        self.recovery_timeout_s = recovery_timeout_s
        self.num_replayed = 0  # streams that went on on a new engine
        self.on_replay: Callable[[], object] | None = None  # called as each one does (a metric)
        self._journals: dict[str, StreamJournal] = {}  # by group id
        self._lost_at: float | None = None  # when the current engine was found dead
        self._given_up = False
        self._changed = asyncio.Event()  # set (then replaced) when an engine is swapped in

    # ---- the supervisor's side -----------------------------------------------------------------
    def lost(self, engine: AsyncEngineClient) -> None:
        """`engine` is dead: if it is the current one, the outage's clock starts (unless a
        stream started it already)."""
        if engine is self.current and self._lost_at is None:
            self._lost_at = time.monotonic()

    def swap(self, engine: AsyncEngineClient) -> None:
        """A new engine: the streams waiting go on there."""
        self.current = engine
        self._lost_at = None
        self._given_up = False
        self._wake()

    def give_up(self) -> None:
        """No engine is coming: the streams waiting end with EngineDeadError now."""
        self._given_up = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- EngineClient --------------------------------------------------------------------------
    @property
    def model_info(self) -> dict[str, Any]:
        return self.current.model_info

    @property
    def load(self) -> EngineLoad | None:
        return self.current.load

    @property
    def is_alive(self) -> bool:
        """The engine serves, or a new one may still come within the outage's bound."""
        if self.current.is_alive:
            return True
        if not self.recovery_timeout_s or self._given_up:
            return False
        return self._lost_at is None or time.monotonic() < self._outage_ends()

    def _outage_ends(self) -> float:
        assert self._lost_at is not None
        return self._lost_at + self.recovery_timeout_s

    async def abort(self, request_id: str) -> None:
        journal = journal_of(self._journals, request_id)
        if journal is None:
            return
        targets = journal.abort(request_id)
        self._wake()  # a stream waiting for an engine may have nothing left to wait for
        engine = self.current
        for target in targets:
            # A dead engine holds nothing to abort, and the closed samples are not resumed.
            with contextlib.suppress(Exception):
                await engine.abort(target)

    async def generate(self, request: Request,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineCoreOutput, None]:
        group_id = request.group_id
        if group_id in self._journals:
            raise InvalidRequestError(f"request id {group_id!r} is already in use")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        journal = StreamJournal(request)
        self._journals[group_id] = journal
        failed: AsyncEngineClient | None = None  # the engine the stream last lost
        refused_at: float | None = None  # when the new engine's full queue first refused it
        try:
            while True:
                engine = await self._live_engine(failed, deadline, journal)
                if failed is not None:
                    for out in journal.ends_owed():
                        journal.note(out)
                        yield out
                if engine is None or journal.complete:
                    return
                if failed is not None and refused_at is None:
                    self.num_replayed += 1
                    if self.on_replay is not None:
                        self.on_replay()
                    logger.info("request %r goes on on the new engine (samples %s)", group_id,
                                journal.open_indices)
                try:
                    remaining = (timeout_s if failed is None or deadline is None
                                 else max(deadline - time.monotonic(), 0.0))
                    async with contextlib.aclosing(run_journal(engine, journal, remaining)) as outputs:
                        async for out in outputs:
                            if out.stop_reason == ENGINE_FAILED and out.error is not None:
                                raise EngineDeadError(out.error)  # it gave up on its workers
                            journal.note(out)
                            yield out
                    return
                except QueueFullError:
                    # A replayed stream is no new request to shed: the new engine's waiting
                    # queue, full of the streams replayed at once, is waited out (bounded).
                    now = time.monotonic()
                    refused_at = refused_at or now
                    if failed is None or now - refused_at >= self.recovery_timeout_s:
                        raise
                    await asyncio.sleep(_REQUEUE_S)
                except RequestTimeoutError:
                    if failed is None:
                        raise
                    # The engine client's timer ran on what was left: name the request's own.
                    raise RequestTimeoutError(f"request {group_id!r} ran past its {timeout_s:g} s "
                                              "timeout") from None
                except EngineDeadError as e:
                    if not self.recovery_timeout_s:
                        raise
                    self.lost(engine)
                    failed, refused_at = engine, None
                    logger.warning("request %r lost its engine (%s): waiting for the next one", group_id,
                                   str(e).splitlines()[0])
        finally:
            del self._journals[group_id]

    async def _live_engine(self, failed: AsyncEngineClient | None, deadline: float | None,
                           journal: StreamJournal) -> AsyncEngineClient | None:
        """The engine to run on: the current one unless it is dead (or the one just lost), else
        the next one, waited for within the outage's bound and the request's deadline; None
        once the caller ended every sample meanwhile."""
        group_id = journal.group_id
        while True:
            engine = self.current
            if engine is not failed and engine.is_alive:
                return engine
            if journal.complete:
                return None
            if not self.recovery_timeout_s:
                raise EngineDeadError("the engine is gone; the server cannot serve requests")
            if self._given_up:
                raise EngineDeadError("the engine is gone and the server gave up restarting it")
            self.lost(engine)
            until = self._outage_ends()
            now = time.monotonic()
            if deadline is not None and deadline <= min(now, until):
                raise RequestTimeoutError(f"request {group_id!r} ran past its timeout while the "
                                          "engine was restarting")
            if now >= until:
                raise EngineDeadError(f"the engine is gone and did not come back within "
                                      f"{self.recovery_timeout_s:g} s")
            changed = self._changed
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError before 3.11
                await asyncio.wait_for(changed.wait(), min(until, deadline or until) - now)


async def run_journal(engine: AsyncEngineClient, journal: StreamJournal,
                      timeout_s: float | None) -> AsyncGenerator[EngineCoreOutput, None]:
    """The records of one engine's part of a journaled stream, in the group's numbering: the
    request itself while nothing was streamed, else each open sample resumed on its own
    (StreamJournal.resumptions). The caller notes each record in the journal. Also what a
    data-parallel stream runs on the replica that takes it over (frontend/data_parallel.py)."""
    runs = journal.resumptions()
    if len(runs) == 1:
        index, request = runs[0]
        async with contextlib.aclosing(engine.generate(request, timeout_s)) as outputs:
            async for out in outputs:
                yield out if index is None else as_sample(out, journal.group_id, index)
        return
    async with contextlib.aclosing(merged_runs(engine.generate, runs, timeout_s)) as merged:
        async for index, out in merged:
            yield as_sample(out, journal.group_id, index)


def as_sample(out: EngineCoreOutput, group_id: str, index: int) -> EngineCoreOutput:
    """A resumed sample's record as sample `index` of the group. Its cached-token count and
    queue time were the first engine's, reported already."""
    out.group_id, out.sample_index = group_id, index
    out.req_id = sample_request_id(group_id, index)
    out.num_cached_tokens = None
    out.queue_time_s = None
    return out


async def merged_runs(generate: Generate, runs: list[tuple[int | None, Request]],
                      timeout_s: float | None) -> AsyncGenerator[tuple[int, EngineCoreOutput], None]:
    """Several resumed samples' streams (each `generate(request, timeout_s)`) as one, in arrival
    order; the first error ends it, and ending it ends (aborts) every stream left."""
    queue: asyncio.Queue[tuple[int, EngineCoreOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, request: Request) -> None:
        try:
            async with contextlib.aclosing(generate(request, timeout_s)) as outputs:
                async for out in outputs:
                    queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((index, e))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(index, request)) for index, request in runs if index is not None]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
