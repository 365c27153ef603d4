"""The central engine actor and its async client: concurrent streams, abort, batched outputs,
TP workers under the actor, and a dead engine answered at once."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from raypaged.config import EngineConfig
from raypaged.core.errors import InvalidRequestError
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.engine.client import AsyncEngineClient, EngineDeadError
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of
from tests.support.ray_state import live_actors, live_placement_groups

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def collect(client: AsyncEngineClient, request: Request) -> list[int]:
    tokens = []
    async for out in client.generate(request):
        tokens.extend(out.new_token_ids)
    return tokens


async def pool_whole(client: AsyncEngineClient, timeout_s: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        stats = (await client.actor.stats.remote())["scheduler"]
        if stats.kv_cache.num_free_blocks == stats.kv_cache.num_blocks:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.parametrize("tp", [1, 2])
def test_concurrent_streams_abort_and_shutdown(tp):
    name = "llama"
    prompts = random_prompts([4, 15, 27], vocab_of(name), seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def scenario():
        client = await AsyncEngineClient.start(EngineConfig(model=str(checkpoint_dir(name)),
                                                            tensor_parallel_size=tp))
        try:
            assert client.model_info["tensor_parallel_size"] == tp
            # A long request, cancelled by its consumer after two outputs, beside three others.
            long_request = Request("long", prompts[2], SamplingParams(temperature=0.0, max_tokens=200,
                                                                      ignore_eos=True))
            async def cancel_early():
                seen = 0
                async for _ in client.generate(long_request):
                    seen += 1
                    if seen == 2:
                        break
                return seen
            results = await asyncio.gather(
                cancel_early(),
                *(collect(client, Request(f"r{i}", p, params)) for i, p in enumerate(prompts)))
            assert results[0] == 2
            for prompt, tokens in zip(prompts, results[1:]):
                assert tokens == hf_greedy(checkpoint_dir(name), tuple(prompt), 12)
            assert await pool_whole(client)
            # Bad input is refused with the engine's own error and harms nothing.
            with pytest.raises(InvalidRequestError):
                await collect(client, Request("bad", [], params))
            with pytest.raises(InvalidRequestError):
                await collect(client, Request("huge", [5] * 10_000, params))
            assert await collect(client, Request("after", prompts[0], params)) == \
                hf_greedy(checkpoint_dir(name), tuple(prompts[0]), 12)
        finally:
            await client.shutdown()

    asyncio.run(scenario())
    assert not {"EngineActor", "RayWorkerActor"} & set(live_actors())
    assert live_placement_groups() == []


def test_dead_engine_is_reported_at_once():
    async def scenario():
        client = await AsyncEngineClient.start(EngineConfig(model=str(checkpoint_dir("llama"))))
        request = Request("doomed", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10_000,
                                                              ignore_eos=True))
        stream = client.generate(request)
        await stream.__anext__()
        ray.kill(client.actor, no_restart=True)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(client, Request("later", [5], SamplingParams(max_tokens=2)))
        assert not client.is_alive
        await client.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


class _GoneEngine:
    """The engine the supervisor replaces (already stopped)."""

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        return None


def test_an_engine_the_cluster_cannot_place_fails_its_start_in_bounded_time():
    """No capacity: start gives up after placement_timeout_s + ray_start_timeout_s and kills
    the actor; the supervisor counts it as a failed start (and gives up after max_attempts)."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raypaged.engine.client import EngineStartTimeoutError
    from raypaged.frontend.supervisor import EngineSupervisor, RestartPolicy

    config = EngineConfig(model=str(checkpoint_dir("llama")), placement_timeout_s=0.5, ray_start_timeout_s=0.5)
    unplaceable = placement_group([{"CPU": 64}])  # more than the cluster has: never placed
    strategy = PlacementGroupSchedulingStrategy(unplaceable)

    async def scenario():
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(EngineStartTimeoutError, match="did not start within 1 s"):
            await AsyncEngineClient.start(config, scheduling_strategy=strategy)
        assert loop.time() - began < 10
        supervisor = EngineSupervisor(lambda: AsyncEngineClient.start(config, scheduling_strategy=strategy),
                                      RestartPolicy(initial_backoff_s=0, max_backoff_s=0, max_attempts=1))
        assert await supervisor.replace(_GoneEngine()) is None  # type: ignore[arg-type]
        assert supervisor.num_failed_attempts == 1 and supervisor.num_restarts == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        remove_placement_group(unplaceable)
    for _ in range(100):  # killing is asynchronous
        if "EngineActor" not in live_actors():
            break
        time.sleep(0.1)
    assert "EngineActor" not in live_actors()


def test_a_grouped_engine_reports_the_hashes_a_router_computes():
    """Gemma 2 (a full and a sliding group): the cache events the engine's outputs carry are the
    plain chain's values of the tokens it computed (prefix_hash_values, what a data-parallel
    router hashes), the other group's never; and a second prompt with that prefix hits it."""
    from raypaged.core.block_hashing import block_hasher, prefix_hash_values
    from raypaged.core.block_pool import read_event

    name, block = "gemma2", 8
    prefix, tail = random_prompts([3 * block, 2], vocab_of(name), seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def scenario():
        client = await AsyncEngineClient.start(EngineConfig(model=str(checkpoint_dir(name)), block_size=block))
        events: list[int] = []
        client.on_batch = lambda batch, load: events.extend(batch)
        try:
            output = await collect(client, Request("first", prefix + [tail[0]], params))
            assert output == hf_greedy(checkpoint_dir(name), tuple(prefix + [tail[0]]), 3)
            stored = [e.hash_value for e in map(read_event, events) if e.stored]
            computed = prefix_hash_values(prefix + [tail[0]] + output, block, None, block_hasher("sha256"))
            assert stored and set(stored) <= set(computed)
            assert stored[:3] == prefix_hash_values(prefix, block, None, block_hasher("sha256"))
            await collect(client, Request("second", prefix + tail, params))
            stats = (await client.actor.stats.remote())["scheduler"]
            assert stats.kv_cache.prefix_cache_hits >= 3 * block
        finally:
            await client.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
