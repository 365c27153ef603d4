"""ServeEnginePool's resumption, without Ray: a fake DeploymentHandle whose replicas stream a
deterministic continuation (each token a function of every token before it, as a greedy model's)
and die on cue, as a replica actor (RayActorError) or its engine (EngineDeadError) would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ray.exceptions import RayActorError, RayTaskError

from raypaged.core.errors import EngineDeadError, InvalidRequestError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.serve.engine_pool import ServeEnginePool
from raypaged.serve.replica_quarantine import ReplicaQuarantine
from raypaged.serve.route_hint import RouteHint

PROMPT = [5, 9, 14]


def next_token(tokens: list[int], seed: int) -> int:
    return (sum(tokens) * 31 + len(tokens) * 7 + seed) % 97 + 3


class FakeReplica:
    def __init__(self, name: str, die_after: int | None = None, death: str = "actor") -> None:
        self.name, self.die_after, self.death = name, die_after, death
        self.streams: list[Request] = []
        self.aborted: list[str] = []

    async def stream(self, request: Request) -> AsyncIterator[Any]:
        self.streams.append(request)
        yield self.name
        params = request.sampling_params
        tokens = list(request.all_token_ids)
        for sample in range(params.n):  # n > 1: the samples' records one after another
            own = list(tokens)
            seed = params.seed if params.n == 1 else (params.seed or 0) * 1_000_003 + sample
            for made in range(len(request.resumed_output_token_ids), params.max_tokens):
                if self.die_after is not None and len(self.streams) == 1 and made >= self.die_after:
                    if self.death == "actor":
                        raise RayActorError()
                    raise RayTaskError("generate", "", EngineDeadError("the engine is gone"))
                own.append(next_token(own, seed or 0))
                await asyncio.sleep(0)
                last = made + 1 == params.max_tokens
                yield EngineCoreOutput(request.request_id, request.group_id, sample, [own[-1]],
                                       finish_reason=FinishReason.LENGTH if last else None)


class FakeCall:
    def __init__(self, stream: AsyncIterator[Any]) -> None:
        self._stream = stream
        self.cancelled = False

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> Any:
        return await self._stream.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Routes each call to the first replica its hint allows (Serve's router in the real one)."""

    def __init__(self, *replicas: FakeReplica) -> None:
        self.replicas = list(replicas)
        self.calls: list[FakeCall] = []

    def options(self, **_: Any) -> FakeHandle:
        return self

    def _pick(self, route: RouteHint) -> FakeReplica:
        return next(r for r in self.replicas if route.allows(r.name))

    @property
    def generate(self) -> Any:
        def remote(request: Request, timeout_s: float | None, route: RouteHint) -> FakeCall:
            call = FakeCall(self._pick(route).stream(request))
            self.calls.append(call)
            return call
        return _Method(remote)

    @property
    def abort(self) -> Any:
        async def aborted(request_id: str, route: RouteHint) -> None:
            self._pick(route).aborted.append(request_id)
        return _Method(aborted)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


def pool(handle: FakeHandle) -> ServeEnginePool:
    # A quarantine of its own: the process's is shared by every pool and router of the process.
    return ServeEnginePool(handle, {"block_size": 4}, recovery_timeout_s=5.0,  # type: ignore[arg-type]
                           quarantine=ReplicaQuarantine())


async def collect(engine: ServeEnginePool, request: Request) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in engine.generate(request):
        assert out.group_id == request.group_id
        tokens.setdefault(out.sample_index, []).extend(out.new_token_ids)
    return tokens


def request(n: int = 1, max_tokens: int = 12, seed: int | None = 3) -> Request:
    return Request("req", list(PROMPT), SamplingParams(n=n, max_tokens=max_tokens, seed=seed, temperature=1.0))


@pytest.mark.parametrize("death", ["actor", "engine"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_replica_dies_goes_on_elsewhere_with_nothing_lost_or_repeated(n, death):
    expected = asyncio.run(collect(pool(FakeHandle(FakeReplica("a"))), request(n)))
    handle = FakeHandle(FakeReplica("a", die_after=5, death=death), FakeReplica("b"))
    engine = pool(handle)
    assert asyncio.run(collect(engine, request(n))) == expected
    assert engine.num_resumed == 1
    # Each open sample resumed on b with the tokens it had streamed (a dies while sample 0 has 5).
    resumed = handle.replicas[1].streams
    assert [len(r.resumed_output_token_ids) for r in resumed] == ([5] if n == 1 else [5, 0])
    assert all(r.prompt_token_ids == PROMPT for r in resumed)
    assert all(call.cancelled for call in handle.calls)  # every engine call was closed
    assert engine.held_out == {"a"}  # no new call of the process goes to a (the router reads it)


def test_nothing_streamed_yet_starts_again_and_every_replica_lost_is_an_error():
    handle = FakeHandle(FakeReplica("a", die_after=0), FakeReplica("b"))
    engine = pool(handle)
    assert asyncio.run(collect(engine, request())) == asyncio.run(collect(pool(FakeHandle(FakeReplica("c"))),
                                                                          request()))
    assert handle.replicas[1].streams[0].resumed_output_token_ids == ()
    dying = [FakeReplica(name, die_after=1) for name in "abcde"]
    engine = pool(FakeHandle(*dying))
    with pytest.raises(EngineDeadError, match="not resumed again"):
        asyncio.run(collect(engine, request()))
    assert [len(r.streams) for r in dying] == [1, 1, 1, 1, 0]  # max_resumes = 3


def test_an_abort_reaches_the_replica_streaming_the_sample_and_ids_are_unique():
    async def scenario() -> None:
        handle = FakeHandle(FakeReplica("a"), FakeReplica("b"))
        engine = pool(handle)
        handle.replicas = handle.replicas[::-1]  # b takes the stream
        stream = engine.generate(request(n=2))
        first = await stream.__anext__()
        with pytest.raises(InvalidRequestError):
            await engine.generate(request()).__anext__()
        await engine.abort("req#1")
        assert handle.replicas[0].aborted == ["req#1"] and handle.replicas[1].aborted == []
        assert first.group_id == "req"
        await stream.aclose()
        assert handle.calls[0].cancelled
        await engine.abort("req")  # nothing streams it any more: ignored
    asyncio.run(scenario())
