"""ReplayingEngine's contract over scripted engines, without Ray: what a new engine is sent after
the old one died (the request again, or each open sample resumed with its tokens, its post-fork
params, no prompt logprobs twice), the records' numbering, aborts routed to resumed samples and
the abort record owed for a sample ended during the outage, and the bounds: the outage's
(EngineDeadError, is_alive False after it), the request's own timeout, the supervisor giving
up, and no replay at all with recovery_timeout_s 0."""

from __future__ import annotations

import asyncio

import pytest

from raypaged.core.errors import EngineDeadError, QueueFullError, RequestTimeoutError
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import ENGINE_FAILED, FinishReason, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.frontend.replay import ReplayingEngine
from tests.support.scripted_engine import FakeEngine, dies_after, finishes, record


async def collect(replay: ReplayingEngine, request: Request,
                  timeout_s: float | None = None) -> list[EngineCoreOutput]:
    outputs = []
    async for out in replay.generate(request, timeout_s):
        outputs.append(out)
    return outputs


def swap_soon(replay: ReplayingEngine, engine: FakeEngine, delay_s: float = 0.05) -> None:
    asyncio.get_running_loop().call_later(delay_s, replay.swap, engine)


def test_n2_samples_resume_alone_with_their_tokens_and_come_back_in_the_groups_numbering():
    params = SamplingParams(n=2, seed=3, max_tokens=8, prompt_logprobs=1, logprobs=1)
    request = Request("g", [1, 2, 3], params)
    first = FakeEngine(dies_after(record("g", 0, [10], cached=2), record("g", 1, [20], cached=2),
                                  record("g", 0, [11])))
    second = FakeEngine(finishes([30]))

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        outputs = await collect(replay, request)
        assert replay.num_replayed == 1
        return outputs

    outputs = asyncio.run(main())
    assert [(o.sample_index, o.new_token_ids) for o in outputs[:3]] == [(0, [10]), (1, [20]), (0, [11])]
    assert sorted((o.group_id, o.req_id, o.sample_index, o.new_token_ids) for o in outputs[3:]) == [
        ("g", "g", 0, [30]), ("g", "g#1", 1, [30])]
    assert all(o.num_cached_tokens is None for o in outputs[3:])  # the first engine's count stands
    sent = {r.request_id: r for r in second.requests}
    assert sent.keys() == {"g#0", "g#1"}
    for index, tokens in ((0, (10, 11)), (1, (20,))):
        resumed = sent[f"g#{index}"]
        assert resumed.group_id == f"g#{index}" and resumed.resumed_output_token_ids == tokens
        assert resumed.sampling_params == SamplingParams(n=2, seed=3, max_tokens=8, logprobs=1).for_sample(index)
        assert resumed.prompt_token_ids == [1, 2, 3]


def test_nothing_streamed_yet_sends_the_request_itself_again():
    request = Request("g", [1, 2], SamplingParams(n=2, max_tokens=4))
    second = FakeEngine(lambda r: [record("g", 0, [5], FinishReason.LENGTH), record("g", 1, [6], FinishReason.LENGTH)])

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(FakeEngine(dies_after()), recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        return await collect(replay, request)

    outputs = asyncio.run(main())
    assert second.requests == [request]
    assert [(o.sample_index, o.new_token_ids) for o in outputs] == [(0, [5]), (1, [6])]


def test_a_sample_aborted_during_the_outage_is_not_resumed_and_gets_its_abort_record():
    request = Request("g", [1, 2], SamplingParams(n=2, max_tokens=4))
    first = FakeEngine(dies_after(record("g", 0, [10]), record("g", 1, [20])))
    second = FakeEngine(finishes([30]))

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        outputs = []
        stream = replay.generate(request)
        outputs.append(await anext(stream))
        outputs.append(await anext(stream))
        waiting = asyncio.ensure_future(anext(stream))  # the engine dies: it waits for the next
        await asyncio.sleep(0.05)
        await replay.abort("g#1")
        replay.swap(second)
        outputs.append(await waiting)
        outputs += [out async for out in stream]
        assert "g#1" in first.aborts  # sent to the dead engine too, harmlessly
        return outputs

    outputs = asyncio.run(main())
    assert [(o.sample_index, o.new_token_ids, o.finish_reason) for o in outputs[2:]] == [
        (1, [], FinishReason.ABORT), (0, [30], FinishReason.LENGTH)]
    assert [r.request_id for r in second.requests] == ["g#0"]


def test_aborting_a_resumed_group_aborts_each_resumed_sample():
    request = Request("g", [1, 2], SamplingParams(n=2, max_tokens=4))
    first = FakeEngine(dies_after(record("g", 0, [10]), record("g", 1, [20])))

    async def main() -> list[str]:
        hold = asyncio.Event()

        async def slow_generate(req: Request, timeout_s: float | None = None):
            second.requests.append(req)
            await hold.wait()
            yield record(req.group_id, 0, [], FinishReason.ABORT)

        second = FakeEngine(finishes([]))
        second.generate = slow_generate  # type: ignore[method-assign]
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second, 0.01)
        task = asyncio.ensure_future(collect(replay, request))
        while len(second.requests) < 2:
            await asyncio.sleep(0.01)
        await replay.abort("g")
        hold.set()
        await task
        return second.aborts

    assert sorted(asyncio.run(main())) == ["g#0", "g#1"]


def test_an_engine_that_does_not_come_back_within_the_bound_ends_the_stream_and_refuses_new_ones():
    request = Request("g", [1, 2], SamplingParams(max_tokens=4))

    async def main() -> None:
        replay = ReplayingEngine(FakeEngine(dies_after(record("g", 0, [10]))), recovery_timeout_s=0.2)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(EngineDeadError, match="did not come back within 0.2 s"):
            await collect(replay, request)
        assert 0.15 < loop.time() - started < 2
        assert not replay.is_alive
        with pytest.raises(EngineDeadError):
            await collect(replay, Request("h", [1], SamplingParams(max_tokens=2)))
        replay.swap(FakeEngine(finishes([1])))  # back: served again
        assert replay.is_alive
        served = await collect(replay, Request("i", [1], SamplingParams(max_tokens=2)))
        assert [o.new_token_ids for o in served] == [[1]]

    asyncio.run(main())


def test_the_supervisor_giving_up_ends_waiting_streams_at_once():
    async def main() -> None:
        replay = ReplayingEngine(FakeEngine(dies_after()), recovery_timeout_s=60)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, replay.give_up)
        started = loop.time()
        with pytest.raises(EngineDeadError, match="gave up"):
            await collect(replay, Request("g", [1], SamplingParams(max_tokens=2)))
        assert loop.time() - started < 5
        assert not replay.is_alive

    asyncio.run(main())


def test_the_requests_own_timeout_runs_on_during_the_outage():
    async def main() -> None:
        replay = ReplayingEngine(FakeEngine(dies_after()), recovery_timeout_s=60)  # type: ignore[arg-type]
        with pytest.raises(RequestTimeoutError, match="while the engine was restarting"):
            await collect(replay, Request("g", [1], SamplingParams(max_tokens=2)), timeout_s=0.1)

    asyncio.run(main())


def test_no_replay_with_recovery_timeout_0():
    async def main() -> None:
        replay = ReplayingEngine(FakeEngine(dies_after(record("g", 0, [10]))), recovery_timeout_s=0)  # type: ignore[arg-type]
        with pytest.raises(EngineDeadError, match="killed"):
            await collect(replay, Request("g", [1], SamplingParams(max_tokens=4)))
        assert not replay.is_alive

    asyncio.run(main())


def test_a_timeout_after_the_replay_names_the_requests_own_timeout():
    request = Request("g", [1, 2], SamplingParams(max_tokens=8))
    first = FakeEngine(dies_after(record("g", 0, [10])))
    second = FakeEngine(lambda r: [RequestTimeoutError("request 'g#0' ran past its 4.93 s timeout")])

    async def main() -> None:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        with pytest.raises(RequestTimeoutError, match="request 'g' ran past its 5 s timeout"):
            await collect(replay, request, timeout_s=5)

    asyncio.run(main())


def test_requests_an_engine_ended_when_it_gave_up_on_its_workers_go_on_on_the_next():
    request = Request("g", [1, 2], SamplingParams(max_tokens=8))
    failed = EngineCoreOutput("g", "g", 0, [], finish_reason=FinishReason.ABORT, stop_reason=ENGINE_FAILED,
                              error="the model workers failed (gave up after 1 restarts)")

    def gives_up(request: Request):
        yield record("g", 0, [10])
        first.alive = False  # as the engine reports once its failed requests' records are out
        yield failed

    first = FakeEngine(gives_up)
    second = FakeEngine(finishes([30]))

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        return await collect(replay, request)

    outputs = asyncio.run(main())
    assert [(o.new_token_ids, o.finish_reason, o.error) for o in outputs] == [
        ([10], None, None), ([30], FinishReason.LENGTH, None)]
    assert second.requests[0].resumed_output_token_ids == (10,)


def test_a_request_the_engine_failed_for_its_own_sake_is_not_replayed():
    request = Request("g", [1, 2], SamplingParams(max_tokens=8))
    failed = EngineCoreOutput("g", "g", 0, [], finish_reason=FinishReason.ABORT,
                              error="structured output grammar did not compile within 1 s")

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(FakeEngine(lambda r: [failed]), recovery_timeout_s=5)  # type: ignore[arg-type]
        return await collect(replay, request)

    assert asyncio.run(main()) == [failed]


def test_an_engine_that_dies_again_is_one_more_outage_and_the_stream_still_goes_on():
    request = Request("g", [1, 2], SamplingParams(max_tokens=8))
    first = FakeEngine(dies_after(record("g", 0, [10])))
    second = FakeEngine(lambda r: [record(r.group_id, 0, [11]), EngineDeadError("the engine is gone: again")])
    third = FakeEngine(finishes([12]))

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        asyncio.get_running_loop().call_later(0.2, replay.swap, third)
        outputs = await collect(replay, request)
        assert replay.num_replayed == 2
        return outputs

    assert [o.new_token_ids for o in asyncio.run(main())] == [[10], [11], [12]]
    assert second.requests[0].resumed_output_token_ids == (10,)
    assert third.requests[0].resumed_output_token_ids == (10, 11)


def test_a_replayed_stream_the_new_engines_full_queue_refuses_tries_again():
    request = Request("g", [1, 2], SamplingParams(max_tokens=8))
    first = FakeEngine(dies_after(record("g", 0, [10])))
    calls = []

    def full_once(r: Request) -> list:
        calls.append(r)
        if len(calls) == 1:
            return [QueueFullError("the waiting queue is full (1 requests)")]
        return [record(r.group_id, 0, [11], FinishReason.LENGTH)]

    second = FakeEngine(full_once)

    async def main() -> list[EngineCoreOutput]:
        replay = ReplayingEngine(first, recovery_timeout_s=5)  # type: ignore[arg-type]
        swap_soon(replay, second)
        return await collect(replay, request)

    assert [o.new_token_ids for o in asyncio.run(main())] == [[10], [11]]
    assert [r.resumed_output_token_ids for r in calls] == [(10,), (10,)]


def test_a_new_request_the_engine_refuses_as_full_is_refused():
    async def main() -> None:
        replay = ReplayingEngine(FakeEngine(lambda r: [QueueFullError("full")]), recovery_timeout_s=5)  # type: ignore[arg-type]
        with pytest.raises(QueueFullError):
            await collect(replay, Request("g", [1], SamplingParams(max_tokens=2)))

    asyncio.run(main())
