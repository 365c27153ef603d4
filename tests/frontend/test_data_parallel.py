"""Two engine replicas behind one DataParallelEngineClient on CPU: a shared prefix lands on the
replica that holds it, outputs are transformers' greedy ones (as one engine's), and a replica
killed mid-stream leaves its streams to finish on the other: n = 1 and n = 2, greedy and seeded,
each sample's tokens those of a fault-free run."""

from __future__ import annotations

import asyncio
import json

import pytest
import ray

from raypaged.config import EngineConfig
from raypaged.core.block_hashing import block_hasher, prefix_hash_values
from raypaged.core.outputs import EngineCoreOutput
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.engine.client import AsyncEngineClient
from raypaged.frontend.data_parallel import DataParallelEngineClient
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of

pytestmark = pytest.mark.integration

NAME = "llama"
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def collect(client: DataParallelEngineClient, request: Request) -> list[int]:
    tokens = []
    async for out in client.generate(request):
        tokens.extend(out.new_token_ids)
    return tokens


async def wait_for(condition, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_prefix_routing_identical_outputs_and_a_killed_replica():
    vocab = vocab_of(NAME)
    system = random_prompts([3 * BLOCK], vocab, seed=5)[0]
    shared = random_prompts([5, 9, 7], vocab, seed=6, prefix=system)
    other = random_prompts([3 * BLOCK + 4], vocab, seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(model=str(checkpoint_dir(NAME)), block_size=BLOCK)

    async def scenario():
        dp = await DataParallelEngineClient.start(2, lambda: AsyncEngineClient.start(config), "prefix",
                                                  restart=False)
        router = dp.router
        try:
            assert dp.model_info["data_parallel_size"] == 2
            first = await collect(dp, Request("s0", shared[0], params))
            home = max(range(2), key=lambda i: router.replicas[i].routed)
            # The replica's cache events reach the router with its outputs.
            await wait_for(lambda: len(router.replicas[home].cached) >= 3)
            # A longer request streams meanwhile (an idle tie goes to replica 0, possibly home):
            # within the load slack the shared prefix still goes home.
            busy = asyncio.ensure_future(collect(dp, Request("o", other, SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True))))
            await wait_for(lambda: sum(s.in_flight for s in router.replicas) == 1)
            before = router.replicas[home].routed
            rest = [await collect(dp, Request(f"s{i}", p, params)) for i, p in enumerate(shared[1:], 1)]
            assert router.replicas[home].routed == before + 2
            assert router.replicas[home].matched_blocks == 6  # 3 blocks each
            other_tokens = (await busy)[:8]
            for prompt, tokens in zip(shared + [other], [first, *rest, other_tokens]):
                assert tokens == hf_greedy(checkpoint_dir(NAME), tuple(prompt), 8)
            stats = (await dp.replicas[home].stats())["scheduler"]
            assert stats.kv_cache.prefix_cache_hits >= 2 * 3 * BLOCK  # both later requests hit
            # Kill the replica streaming a long request: it finishes on the other, same tokens.
            long_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            long_prompt = shared[1]
            tokens: list[int] = []
            stream = dp.generate(Request("long", long_prompt, long_params))
            async for out in stream:
                tokens += out.new_token_ids
                if len(tokens) >= 3 and router.replicas[home].alive:
                    ray.kill(dp.replicas[home].actor, no_restart=True)
            assert tokens == hf_greedy(checkpoint_dir(NAME), tuple(long_prompt), 40)
            assert not router.replicas[home].alive and dp.is_alive
            # New requests go to the survivor.
            assert await collect(dp, Request("after", shared[2], params)) == rest[1]
            assert router.replicas[1 - home].routed >= 2  # the continuation and "after"
        finally:
            await dp.shutdown()

    asyncio.run(scenario())


async def collect_samples(client: DataParallelEngineClient, request: Request,
                          seen: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """Each sample's tokens; every record of the group's numbering, each sample finished once."""
    samples: dict[int, list[int]] = {} if seen is None else seen
    finished: list[int] = []
    out: EngineCoreOutput
    async for out in client.generate(request):
        assert out.group_id == request.group_id and out.sample_index not in finished
        samples.setdefault(out.sample_index, []).extend(out.new_token_ids)
        if out.finished:
            finished.append(out.sample_index)
    assert sorted(finished) == list(range(request.sampling_params.n))
    return samples


def host_gib(num_blocks: int) -> float:
    """kv_offload_size for a host tier of num_blocks blocks of the fp32 test checkpoint."""
    config = json.loads((checkpoint_dir(NAME) / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * BLOCK * config["num_key_value_heads"] * head_dim * 4
    return num_blocks * per_block / 2**30


def test_host_tier_hits_route_and_n2_seeded_streams_resume_on_another_replica():
    """Replicas with a small GPU pool and a host tier behind it. (1) A prefix the GPU pool of
    one replica evicted into its host tier still draws its requests there (an idle tie would go
    to replica 0), and they hit it there. (2) A replica killed while streaming greedy n=2,
    seeded n=2 and seeded n=1: each sample's tokens are a fault-free run's."""
    vocab = vocab_of(NAME)
    config = EngineConfig(model=str(checkpoint_dir(NAME)), block_size=BLOCK, num_gpu_blocks_override=24,
                          kv_offload_size=host_gib(64))
    system = random_prompts([4 * BLOCK], vocab, seed=9)[0]
    first, again = random_prompts([3, 5], vocab, seed=10, prefix=system)
    floods = random_prompts([10 * BLOCK] * 3, vocab, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    system_values = set(prefix_hash_values(system, BLOCK, None, block_hasher("sha256")))
    prompt = random_prompts([2 * BLOCK + 3], vocab, seed=8)[0]
    runs = {"greedy2": SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True),
            "seeded2": SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
            "seeded1": SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)}

    async def host_tier_routing(dp: DataParallelEngineClient) -> None:
        router = dp.router
        # A long stream keeps replica 0 busier, so the prefix and the floods go to replica 1.
        long = asyncio.ensure_future(collect(dp, Request("long", first[:5], SamplingParams(
            temperature=0.0, max_tokens=300, ignore_eos=True))))
        await wait_for(lambda: router.replicas[0].in_flight == 1)
        assert await collect(dp, Request("first", first, greedy)) == hf_greedy(
            checkpoint_dir(NAME), tuple(first), 8)
        for i, flood in enumerate(floods):  # they evict the prefix from replica 1's GPU pool
            await collect(dp, Request(f"flood{i}", flood, one_token))
        assert router.replicas[1].routed == 4 and router.replicas[0].routed == 1
        state = router.replicas[1]
        await wait_for(lambda: system_values <= state.host_cached and not system_values & state.cached)
        await dp.abort("long")
        await long
        await wait_for(lambda: router.replicas[0].in_flight == 0)
        # Both idle; only replica 1 holds the prefix, in its host tier.
        before = (await dp.replicas[1].stats())["scheduler"].kv_cache
        assert await collect(dp, Request("again", again, greedy)) == hf_greedy(
            checkpoint_dir(NAME), tuple(again), 8)
        assert (state.routed, state.host_matched_blocks) == (5, 4)
        after = (await dp.replicas[1].stats())["scheduler"].kv_cache
        assert after.host_cache_hits - before.host_cache_hits == 4 * BLOCK

    async def resume_after_a_kill(dp: DataParallelEngineClient) -> None:
        fault_free = {name: await collect_samples(dp, Request(f"ref-{name}", prompt, params))
                      for name, params in runs.items()}
        assert fault_free["greedy2"][0] == fault_free["greedy2"][1] == hf_greedy(
            checkpoint_dir(NAME), tuple(prompt), 24)
        assert fault_free["seeded2"][0] != fault_free["seeded2"][1]  # each sample its own seed
        # The same three at once: the prefix sends them to the replica that holds it.
        seen: dict[str, dict[int, list[int]]] = {name: {} for name in runs}
        streams = {name: asyncio.ensure_future(collect_samples(dp, Request(name, prompt, params), seen[name]))
                   for name, params in runs.items()}
        await wait_for(lambda: all(len(seen[name]) == runs[name].n
                                   and all(len(t) >= 3 for t in seen[name].values()) for name in runs))
        home = dp._owners["greedy2"]
        assert all(dp._owners[name] == home for name in runs)
        ray.kill(dp.replicas[home].actor, no_restart=True)
        # Killed mid-stream: no sample had all its tokens yet (max_tokens 24).
        assert all(len(t) < 24 for name in runs for t in seen[name].values())
        routed_before = dp.router.replicas[1 - home].routed
        results = {name: await stream for name, stream in streams.items()}
        assert not dp.router.replicas[home].alive
        assert results == fault_free
        assert dp.router.replicas[1 - home].routed == routed_before + 3  # each went on there

    async def scenario():
        dp = await DataParallelEngineClient.start(2, lambda: AsyncEngineClient.start(config), "prefix",
                                                  restart=False)
        try:
            await host_tier_routing(dp)
            await resume_after_a_kill(dp)
        finally:
            await dp.shutdown()

    asyncio.run(scenario())
