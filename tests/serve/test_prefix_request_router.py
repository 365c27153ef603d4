"""Serve's request router for raypaged replicas, without Serve running: replicas' routing stats
and a gRPC GenerateRequest's prompt decide the ranking."""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, gRPCRequest
from ray.serve._private.request_router.common import RequestRoutingContext

from raypaged.core.block_hashing import block_hasher, prefix_hash_values
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.prefix_request_router import PrefixAwareRequestRouter, routing_value
from raypaged.serve.replica_quarantine import FRESH_SNAPSHOTS, ReplicaQuarantine
from raypaged.serve.route_hint import RouteHint

BLOCK = 4
PROMPT = list(range(10, 22))  # three full blocks
OTHER = list(range(50, 62))


class FakeReplica:
    def __init__(self, name: str, stats: dict) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="raypaged"))
        self.routing_stats = stats
        self.max_ongoing_requests = 256


class FakeResult:
    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)


def hashes(prompt: list[int], salt: str | None = None) -> list[int]:
    return [routing_value(v) for v in prefix_hash_values(prompt, BLOCK, salt, block_hasher("sha256"))]


def pending(args: list, **kwargs) -> SimpleNamespace:
    return SimpleNamespace(args=args, kwargs=kwargs, routing_context=RequestRoutingContext())


def request(prompt: list[int]) -> SimpleNamespace:
    """As Serve's gRPC proxy sends it: a gRPCRequest, pickled."""
    message = gRPCRequest(user_request_proto=pb.GenerateRequest(prompt_token_ids=prompt))
    return pending([pickle.dumps(message)])


def ingress_call(prompt: list[int], salt: str | None = None, resumed: tuple[int, ...] = (),
                 route: RouteHint | None = None) -> SimpleNamespace:
    """As the ingress's engine pool calls generate: the core Request, its timeout, the hint."""
    core = Request("r", prompt, SamplingParams(max_tokens=4), cache_salt=salt, resumed_output_token_ids=resumed)
    return pending([core, None], route=route or RouteHint())


def make_router() -> PrefixAwareRequestRouter:
    """Inside an event loop: Serve's router starts tasks as it is made."""
    router = PrefixAwareRequestRouter(DeploymentID(name="raypaged"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=BLOCK)
    router.quarantine = ReplicaQuarantine()  # not the process's: tests share it
    return router


def test_the_replica_holding_the_prefix_ranks_first_and_routed_prompts_stay_pending():
    asyncio.run(_holding_and_pending())


async def _holding_and_pending():
    router = make_router()
    idle = {"cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
    a = FakeReplica("a", dict(idle))
    b = FakeReplica("b", {**idle, "cached": hashes(PROMPT)})
    router.update_replicas([a, b])
    ranks = (await router.choose_replicas([a, b], request(PROMPT)))
    assert ranks[0] == [b] and ranks[1] == [a]
    # A new prefix: the idle tie goes to the first replica; routed there, it is pending there.
    first = (await router.choose_replicas([a, b], request(OTHER)))[0][0]
    result = FakeResult()
    router.on_request_routed(request(OTHER), first.replica_id, result)
    assert (await router.choose_replicas([a, b], request(OTHER)))[0] == [first]
    for callback in result.callbacks:
        callback(None)
    state = router._router.replicas[router._indices[first.replica_id]]
    assert state.in_flight == 0 and not state.pending


def test_load_and_a_removed_replica():
    asyncio.run(_load_and_removed())


async def _load_and_removed():
    router = make_router()
    a = FakeReplica("a", {"cached": hashes(PROMPT), "num_waiting": 20, "num_running": 8, "kv_usage": 0.5})
    b = FakeReplica("b", {"cached": [], "num_waiting": 0, "num_running": 1, "kv_usage": 0.1})
    router.update_replicas([a, b])
    assert (await router.choose_replicas([a, b], request(PROMPT)))[0] == [b]  # a's queue is too long
    router.update_replicas([b])
    assert (await router.choose_replicas([b], request(PROMPT))) == [[b]]


def test_a_request_it_cannot_read_is_placed_by_load():
    asyncio.run(_unreadable())


async def _unreadable():
    router = make_router()
    a = FakeReplica("a", {"cached": [], "num_waiting": 5, "num_running": 0, "kv_usage": 0.0})
    b = FakeReplica("b", {"cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0})
    router.update_replicas([a, b])
    http = pending([object()])  # Serve's HTTP proxy: no body to read
    assert (await router.choose_replicas([a, b], http))[0] == [b]


class _Payload:
    """Pickles to a call of os.system: what a hostile byte string would carry."""

    def __reduce__(self):
        import os

        return os.system, ("echo pwned > /dev/null",)


def test_only_the_proxys_request_is_unpickled():
    from raypaged.serve.prefix_request_router import generate_request_of

    message = generate_request_of(request([5, 6, 7]))
    assert message is not None and list(message.prompt_token_ids) == [5, 6, 7]
    called = []
    import os

    hostile = pending([pickle.dumps(_Payload())])
    real = os.system
    os.system = lambda *a: called.append(a) or 0  # type: ignore[assignment]
    try:
        assert generate_request_of(hostile) is None
    finally:
        os.system = real
    assert not called


def test_the_ingress_request_is_placed_by_its_salted_prompt_and_resumed_tokens():
    asyncio.run(_ingress_request())


async def _ingress_request():
    router = make_router()
    idle = {"cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
    a = FakeReplica("a", dict(idle))
    b = FakeReplica("b", {**idle, "cached": hashes(PROMPT, "tenant"), "num_waiting": 1})
    router.update_replicas([a, b])
    assert (await router.choose_replicas([a, b], ingress_call(PROMPT, "tenant")))[0] == [b]
    # Another salt is another prefix: no replica holds it, the less loaded one takes it.
    assert (await router.choose_replicas([a, b], ingress_call(PROMPT, "other")))[0] == [a]
    # A resumed stream's prompt and tokens are hashed as one sequence, as the engine will.
    c = FakeReplica("c", {**idle, "cached": hashes(PROMPT[:8] + OTHER[:4]), "num_waiting": 1})
    router.update_replicas([a, b, c])
    call = ingress_call(PROMPT[:8], resumed=tuple(OTHER[:4]))
    assert (await router.choose_replicas([a, b, c], call))[0] == [c]


def test_a_route_hint_avoids_lost_replicas_and_pins_one():
    asyncio.run(_route_hints())


async def _route_hints():
    router = make_router()
    idle = {"cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
    a = FakeReplica("a", {**idle, "cached": hashes(PROMPT)})
    b = FakeReplica("b", dict(idle))
    router.update_replicas([a, b])
    avoiding_a = ingress_call(PROMPT, route=RouteHint(avoid=frozenset({"a"})))
    assert await router.choose_replicas([a, b], avoiding_a) == [[b]]
    assert avoiding_a.routing_context.should_backoff  # Serve waits before asking again
    pinned = ingress_call(OTHER, route=RouteHint(pin="b"))
    assert await router.choose_replicas([a, b], pinned) == [[b]]
    # Nothing allowed (the pinned replica is gone): no choice, and Serve backs off.
    assert await router.choose_replicas([a], pinned) == []
    assert await router.choose_replicas([a, b], ingress_call(PROMPT, route=RouteHint(avoid=frozenset("ab")))) == []


def test_a_replica_whose_engine_died_takes_no_new_call_until_it_is_replaced_or_answers_again():
    asyncio.run(_held_out())


async def _held_out():
    router = make_router()
    idle = {"cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0, "engine_alive": True}
    a = FakeReplica("a", {**idle, "cached": hashes(PROMPT)})
    b = FakeReplica("b", dict(idle))
    router.update_replicas([a, b])
    assert (await router.choose_replicas([a, b], ingress_call(PROMPT)))[0] == [a]
    # a's engine dies: its next routing stats say so, and no unpinned call goes there, though
    # it holds the prompt's prefix and Serve still offers it.
    a.routing_stats = {**a.routing_stats, "engine_alive": False}
    assert await router.choose_replicas([a, b], ingress_call(PROMPT)) == [[b]]
    assert router.num_held_out == 1
    assert await router.choose_replicas([a, b], ingress_call(OTHER, route=RouteHint(pin="a"))) == [[a]]
    # Only a: no candidate (Serve backs off until a replica comes).
    assert await router.choose_replicas([a], ingress_call(PROMPT)) == []
    # Serve replaces a by c: a is released (it is gone), c takes calls.
    c = FakeReplica("c", {**idle, "cached": hashes(PROMPT)})
    router.update_replicas([b, c])
    assert router.quarantine.held() == frozenset()
    assert (await router.choose_replicas([b, c], ingress_call(PROMPT)))[0] == [c]
    # A replica held for a lost call (the pool's hold) answers again: fresh live snapshots
    # release it, the first alone does not.
    router.quarantine.hold("c", "a call found its actor unavailable")
    for seen in range(1, FRESH_SNAPSHOTS + 1):
        c.routing_stats = dict(c.routing_stats)  # a new snapshot, as each poll brings
        ranks = await router.choose_replicas([b, c], ingress_call(PROMPT))
        assert ranks[0] == ([b] if seen < FRESH_SNAPSHOTS else [c]), seen
    # A call that finds a replica's actor dead holds it too (Serve tells the router).
    router.on_replica_actor_died(b.replica_id)
    assert router.quarantine.held() == {"b"}


def test_a_replicas_host_tier_reaches_the_router_and_ranks_below_the_gpu():
    asyncio.run(_host_tier())


async def _host_tier():
    from raypaged.core.block_pool import removed_event, stored_event
    from raypaged.frontend.prefix_router import PrefixRouter
    from raypaged.serve.prefix_request_router import routing_stats

    # A replica's own view: its engine evicted the prompt's blocks from the GPU into the host tier.
    full = prefix_hash_values(PROMPT, BLOCK, None, block_hasher("sha256"))
    view = PrefixRouter(1)
    view.apply_events(0, [stored_event(v) for v in full])
    view.apply_events(0, [e for v in full for e in (removed_event(v), stored_event(v, host=True))])
    stats = routing_stats(view.replicas[0])
    assert stats["cached"] == [] and sorted(stats["host_cached"]) == sorted(hashes(PROMPT))
    router = make_router()
    idle = {"cached": [], "host_cached": [], "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}
    a = FakeReplica("a", dict(idle))
    b = FakeReplica("b", stats)
    router.update_replicas([a, b])
    assert (await router.choose_replicas([a, b], ingress_call(PROMPT)))[0] == [b]  # host hits beat none
    state = router._router.replicas[router._indices[b.replica_id]]
    assert state.host_cached == set(hashes(PROMPT)) and not state.cached
    # The same prefix on another replica's GPU wins over b's host copy.
    c = FakeReplica("c", {**idle, "cached": hashes(PROMPT)})
    router.update_replicas([a, b, c])
    assert (await router.choose_replicas([a, b, c], ingress_call(PROMPT)))[0] == [c]
