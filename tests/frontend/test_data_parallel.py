"""Two engine replicas (a small GPU pool each, a host tier behind it) behind one
DataParallelEngineClient on CPU, one pair for the module's phases in order: a shared prefix
lands on the replica that holds it and outputs are transformers' greedy ones (as one engine's);
a prefix one replica's GPU pool evicted into its host tier still draws its request there; a
replica killed mid-stream leaves its streams to finish on the other: n = 1 and n = 2, greedy and
seeded, each sample's tokens those of a fault-free run."""

from __future__ import annotations

import asyncio

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
from tests.support.host_tier import host_gib

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


def test_prefix_routing_host_tier_hits_and_streams_resumed_after_a_killed_replica():
    config = EngineConfig(model=str(checkpoint_dir(NAME)), block_size=BLOCK, num_gpu_blocks_override=24,
                          kv_offload_size=host_gib(64, BLOCK, NAME))

    async def scenario():
        dp = await DataParallelEngineClient.start(2, lambda: AsyncEngineClient.start(config), "prefix",
                                                  restart=False)
        try:
            assert dp.model_info["data_parallel_size"] == 2
            await prefix_routing(dp)
            await host_tier_routing(dp)
            await resume_after_a_kill(dp)
        finally:
            await dp.shutdown()

    asyncio.run(scenario())


async def prefix_routing(dp: DataParallelEngineClient) -> None:
    vocab = vocab_of(NAME)
    system = random_prompts([3 * BLOCK], vocab, seed=5)[0]
    shared = random_prompts([5, 9, 7], vocab, seed=6, prefix=system)
    other = random_prompts([3 * BLOCK + 4], vocab, seed=7)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    router = dp.router
    first = await collect(dp, Request("s0", shared[0], params))
    home = max(range(2), key=lambda i: router.replicas[i].routed)
    # The replica's cache events reach the router with its outputs.
    await wait_for(lambda: len(router.replicas[home].cached) >= 3)
    # A longer request streams meanwhile (an idle tie goes to replica 0, possibly home):
    # within the load slack the shared prefix still goes home.
    # It is aborted once the others are done, so it is in flight throughout (a short one could
    # finish between two polls of the router's count).
    other_tokens: list[int] = []

    async def stream_other() -> None:
        async for out in dp.generate(Request("o", other, SamplingParams(
                temperature=0.0, max_tokens=200, ignore_eos=True))):
            other_tokens.extend(out.new_token_ids)

    busy = asyncio.ensure_future(stream_other())
    await wait_for(lambda: sum(s.in_flight for s in router.replicas) == 1)
    before = router.replicas[home].routed
    rest = [await collect(dp, Request(f"s{i}", p, params)) for i, p in enumerate(shared[1:], 1)]
    assert router.replicas[home].routed == before + 2
    assert router.replicas[home].matched_blocks == 6  # 3 blocks each
    await wait_for(lambda: len(other_tokens) >= 8)
    await dp.abort("o")
    await busy
    await wait_for(lambda: sum(s.in_flight for s in router.replicas) == 0)
    other_tokens = other_tokens[:8]
    for prompt, tokens in zip(shared + [other], [first, *rest, other_tokens]):
        assert tokens == hf_greedy(checkpoint_dir(NAME), tuple(prompt), 8)
    stats = (await dp.replicas[home].stats())["scheduler"]
    assert stats.kv_cache.prefix_cache_hits >= 2 * 3 * BLOCK  # both later requests hit


async def host_tier_routing(dp: DataParallelEngineClient) -> None:
    vocab = vocab_of(NAME)
    system = random_prompts([4 * BLOCK], vocab, seed=9)[0]
    first, again = random_prompts([3, 5], vocab, seed=10, prefix=system)
    floods = random_prompts([10 * BLOCK] * 3, vocab, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    system_values = set(prefix_hash_values(system, BLOCK, None, block_hasher("sha256")))
    router = dp.router
    await wait_for(lambda: router.replicas[0].in_flight == router.replicas[1].in_flight == 0)
    routed = [s.routed for s in router.replicas]
    # A long stream keeps replica 0 busier, so the prefix and the floods go to replica 1.
    long = asyncio.ensure_future(collect(dp, Request("long", first[:5], SamplingParams(
        temperature=0.0, max_tokens=300, ignore_eos=True))))
    await wait_for(lambda: router.replicas[0].in_flight == 1)
    assert await collect(dp, Request("first", first, greedy)) == hf_greedy(checkpoint_dir(NAME), tuple(first), 8)
    for i, flood in enumerate(floods):  # they evict the prefix from replica 1's GPU pool
        await collect(dp, Request(f"flood{i}", flood, SamplingParams(max_tokens=1)))
    assert [s.routed for s in router.replicas] == [routed[0] + 1, routed[1] + 4]
    state = router.replicas[1]
    await wait_for(lambda: system_values <= state.host_cached and not system_values & state.cached)
    await dp.abort("long")
    await long
    await wait_for(lambda: router.replicas[0].in_flight == 0)
    # Both idle (a tie would go to replica 0); only replica 1 holds the prefix, in its host tier.
    before = (await dp.replicas[1].stats())["scheduler"].kv_cache
    host_matched = state.host_matched_blocks
    assert await collect(dp, Request("again", again, greedy)) == hf_greedy(checkpoint_dir(NAME), tuple(again), 8)
    assert (state.routed, state.host_matched_blocks) == (routed[1] + 5, host_matched + 4)
    after = (await dp.replicas[1].stats())["scheduler"].kv_cache
    assert after.host_cache_hits - before.host_cache_hits == 4 * BLOCK


async def resume_after_a_kill(dp: DataParallelEngineClient) -> None:
    prompt = random_prompts([2 * BLOCK + 3], vocab_of(NAME), seed=8)[0]
    runs = {"greedy1": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            "greedy2": SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True),
            "seeded2": SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
            "seeded1": SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)}
    router = dp.router
    fault_free = {name: await collect_samples(dp, Request(f"ref-{name}", prompt, params))
                  for name, params in runs.items()}
    greedy = hf_greedy(checkpoint_dir(NAME), tuple(prompt), 24)
    assert fault_free["greedy1"][0] == fault_free["greedy2"][0] == fault_free["greedy2"][1] == greedy
    assert fault_free["seeded2"][0] != fault_free["seeded2"][1]  # each sample its own seed
    # The same four at once: the prefix sends them to the replica that holds it (a slack that
    # lets four streams pile onto one replica).
    router.balance_abs = 4.0
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
    routed_before = router.replicas[1 - home].routed
    results = {name: await stream for name, stream in streams.items()}
    assert not router.replicas[home].alive and dp.is_alive
    assert results == fault_free
    assert router.replicas[1 - home].routed == routed_before + 4  # each went on there
    # New requests go to the survivor.
    assert await collect_samples(dp, Request("after", prompt, runs["greedy1"])) == {0: greedy}
    assert router.replicas[1 - home].routed == routed_before + 5
