"""DataParallelEngineClient over scripted replicas, without Ray: what the replica that takes a
stream over is sent after the first died (the request again, or each open sample resumed alone
with its tokens and post-fork params), the records' numbering, and aborts reaching the resumed
samples. The same over real engines: tests/frontend/test_data_parallel.py."""

from __future__ import annotations

import asyncio

from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import FinishReason, Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.frontend.data_parallel import DataParallelEngineClient
from tests.support.scripted_engine import FakeEngine, dies_after, finishes, record

INFO = {"block_size": 2, "enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256"}


def replicas(*engines: FakeEngine) -> DataParallelEngineClient:
    for engine in engines:
        engine.model_info = INFO
    return DataParallelEngineClient(list(engines))  # type: ignore[arg-type]


def test_n2_samples_resume_alone_on_another_replica_in_the_groups_numbering():
    params = SamplingParams(n=2, seed=3, max_tokens=8)
    request = Request("g", [1, 2, 3], params)
    first = FakeEngine(dies_after(record("g", 0, [10, 11]), record("g", 1, [20])))
    second = FakeEngine(finishes([30]))

    async def main() -> list[EngineCoreOutput]:
        dp = replicas(first, second)
        outputs = [out async for out in dp.generate(request)]
        assert dp.router.replicas[0].in_flight == dp.router.replicas[1].in_flight == 0
        await dp.shutdown()
        return outputs

    outputs = asyncio.run(main())
    assert [r.request_id for r in first.requests] == ["g"]
    resumed = sorted(second.requests, key=lambda r: r.request_id)
    assert [(r.request_id, r.resumed_output_token_ids, r.sampling_params) for r in resumed] == [
        ("g#0", (10, 11), params.for_sample(0)), ("g#1", (20,), params.for_sample(1))]
    assert [(o.sample_index, o.new_token_ids) for o in outputs[:2]] == [(0, [10, 11]), (1, [20])]
    # The resumed samples' records, renamed into the group's numbering.
    assert sorted((o.req_id, o.sample_index, o.new_token_ids) for o in outputs[2:]) == [
        ("g", 0, [30]), ("g#1", 1, [30])]
    assert all(o.group_id == "g" for o in outputs)


def test_a_request_that_streamed_nothing_starts_again_and_a_finished_sample_stays_finished():
    request = Request("g", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    first = FakeEngine(dies_after(record("g", 1, [20], FinishReason.STOP)))
    second = FakeEngine(finishes([30]))
    nothing = Request("h", [1, 2, 3], SamplingParams(max_tokens=4))
    third, fourth = FakeEngine(dies_after()), FakeEngine(finishes([40]))

    async def main() -> tuple[list[EngineCoreOutput], list[EngineCoreOutput]]:
        dp = replicas(first, second)
        outputs = [out async for out in dp.generate(request)]
        again = replicas(third, fourth)
        restarted = [out async for out in again.generate(nothing)]
        return outputs, restarted

    outputs, restarted = asyncio.run(main())
    assert [r.request_id for r in second.requests] == ["g#0"]  # sample 1 had finished
    assert [(o.sample_index, o.new_token_ids) for o in outputs] == [(1, [20]), (0, [30])]
    assert [r is nothing for r in fourth.requests] == [True]
    assert [o.new_token_ids for o in restarted] == [[40]]


def test_aborting_a_resumed_group_aborts_each_resumed_sample_on_its_new_replica():
    request = Request("g", [1, 2], SamplingParams(n=2, max_tokens=4))
    first = FakeEngine(dies_after(record("g", 0, [10]), record("g", 1, [20])))
    second = FakeEngine(finishes([]))
    hold = asyncio.Event()

    async def slow_generate(req: Request, timeout_s: float | None = None):
        second.requests.append(req)
        await hold.wait()
        yield record(req.group_id, 0, [], FinishReason.ABORT)

    second.generate = slow_generate  # type: ignore[method-assign]

    async def main() -> None:
        dp = replicas(first, second)
        task = asyncio.ensure_future(_drain(dp, request))
        while len(second.requests) < 2:
            await asyncio.sleep(0.01)
        await dp.abort("g#1")  # one sample: the resumed request of that name
        await dp.abort("g")  # then the group: the sample still open
        hold.set()
        await task

    asyncio.run(main())
    assert second.aborts == ["g#1", "g#0"]


async def _drain(dp: DataParallelEngineClient, request: Request) -> None:
    async for _ in dp.generate(request):
        pass
