"""Which data-parallel replica gets a request: the longest cached prefix, weighed against load.

Pure bookkeeping (no Ray, no asyncio), so it is tested alone (tests/frontend/test_prefix_router.py)
and shared by the frontend's data-parallel client (frontend/data_parallel.py) and the Ray Serve
request router (serve/prefix_request_router.py).

What the router knows of each replica:
- the hash values of the full blocks its prefix cache holds, per tier: the engine reports every
  value that enters or leaves its GPU pool's cache and its host tier (core/block_pool.py's cache
  events, carried on its outputs), and the router replays them in order. A block the GPU pool
  evicts into the host tier is still held by the replica (a host hit: copied back instead of
  recomputed); one the host tier drops is gone. A prompt's values come from core's own chain
  (core/block_hashing.py prefix_hash_values), so they mean the same here as in every engine.
  Until its engine reports them, a routed request's prompt blocks count as held by its replica
  (pending, until its stream ends): a burst sharing a new prefix finds it there at once, instead
  of every request of the burst missing everywhere. A replica that died or restarted is
  forgotten wholesale: its new engine starts empty.
- its load: the requests routed to it whose streams have not ended (counted here, so it is never
  stale), plus the waiting queue and the KV usage of the engine's last EngineLoad.

Policies (`--routing-policy`):
- prefix: among the replicas whose load is within `balance_abs + balance_rel * min_load` of the
  least loaded one, the one holding the most of the prompt's leading blocks (ties: the less
  loaded, then the lower index). What a replica holds is counted as its engine looks it up: the
  leading run on the GPU (cached or pending), then the run after it in the host tier, a host
  block weighing `host_weight` (< 1: it saves the recompute but costs a copy to the GPU, so a
  GPU hit of the same length wins). One hot prefix therefore fills one replica only until it
  is out of balance; the next request with it lands elsewhere and that replica caches it too. A
  replica at or above `kv_pressure` KV usage is a candidate only when every replica is.
- p2c: power of two choices, two distinct random live replicas, the less loaded (Serve's default).
- round_robin: the live replicas in turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from raypaged.core.block_pool import read_event
from raypaged.core.outputs import EngineLoad

ROUTING_POLICIES = ("prefix", "p2c", "round_robin")


class NoReplicaError(RuntimeError):
    """Every replica is dead (or excluded): nothing can take the request now."""


@dataclass
class ReplicaState:
    cached: set[int] = field(default_factory=set)  # hash values of the blocks its GPU cache holds
    host_cached: set[int] = field(default_factory=set)  # ... and its host tier
    pending: dict[int, int] = field(default_factory=dict)  # value -> in-flight requests bringing it
    alive: bool = True
    in_flight: int = 0  # routed here, stream not ended
    load: EngineLoad | None = None  # the engine's last snapshot
    # Totals since start (metrics): requests routed here, their full prompt blocks, how many
    # of those the router saw cached here when it chose, and of those how many in the host tier.
    routed: int = 0
    prompt_blocks: int = 0
    matched_blocks: int = 0
    host_matched_blocks: int = 0

    @property
    def load_score(self) -> float:
        waiting = self.load.num_waiting if self.load is not None else 0
        return float(self.in_flight + waiting)

    @property
    def kv_usage(self) -> float:
        return self.load.kv_usage if self.load is not None else 0.0


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int  # leading prompt blocks the chosen replica holds (either tier), as the router knew it
    hash_values: tuple[int, ...]  # the prompt's full blocks (pending at the replica until it ends)
    host_matched_blocks: int = 0  # of matched_blocks, those in its host tier


@dataclass(frozen=True)
class Match:
    """A replica's leading run of a prompt's blocks, as its engine's lookup would find it."""

    gpu: int  # on the GPU (cached, or pending: routed there, not reported yet)
    host: int  # after those, in the host tier

    @property
    def blocks(self) -> int:
        return self.gpu + self.host


class PrefixRouter:
    def __init__(self, num_replicas: int, policy: str = "prefix", *, balance_abs: float = 2.0,
                 balance_rel: float = 0.2, kv_pressure: float = 0.95, host_weight: float = 0.5,
                 seed: int = 0) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.replicas = [ReplicaState() for _ in range(num_replicas)]
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.kv_pressure = kv_pressure
        if not 0.0 <= host_weight <= 1.0:
            raise ValueError(f"host_weight must be in [0, 1], got {host_weight}")
        self.host_weight = host_weight
        self._rng = random.Random(seed)
        self._next = 0  # round robin's next replica

    # ---- what the replicas report ----------------------------------------------------------------
    def apply_events(self, replica: int, events: list[int]) -> None:
        """Replay a batch of the replica's cache events, in order (each tier's set its own)."""
        state = self.replicas[replica]
        gpu, host = state.cached, state.host_cached
        for event in events:
            value, stored, in_host = read_event(event)
            tier = host if in_host else gpu
            if stored:
                tier.add(value)
            else:
                tier.discard(value)

    def update_load(self, replica: int, load: EngineLoad) -> None:
        self.replicas[replica].load = load

    def mark_dead(self, replica: int) -> None:
        """The replica's engine is gone: no request goes there, and what it cached is forgotten."""
        state = self.replicas[replica]
        state.alive, state.load = False, None
        state.cached.clear()
        state.host_cached.clear()
        state.pending.clear()

    def mark_alive(self, replica: int) -> None:
        """A new engine took the replica's place: empty cache, no load yet."""
        state = self.replicas[replica]
        state.alive, state.load = True, None
        state.cached.clear()
        state.host_cached.clear()
        state.pending.clear()
        state.in_flight = 0

    def finished(self, route: Route) -> None:
        """A stream routed by `route` ended (finished, failed or cancelled): from now on only the
        replica's own events say whether it holds the prompt's blocks."""
        state = self.replicas[route.replica]
        state.in_flight = max(0, state.in_flight - 1)
        pending = state.pending
        for value in route.hash_values:
            count = pending.get(value, 0) - 1
            if count > 0:
                pending[value] = count
            else:
                pending.pop(value, None)

    # ---- choosing ----------------------------------------------------------------------------------
    def match(self, replica: int, hash_values: list[int]) -> Match:
        """The replica's leading run of the prompt's blocks: on the GPU (cached or pending), then
        in the host tier (the first block in neither ends it)."""
        state = self.replicas[replica]
        cached, pending, host = state.cached, state.pending, state.host_cached
        num_gpu = 0
        for value in hash_values:
            if value not in cached and value not in pending:
                break
            num_gpu += 1
        num_host = 0
        if host:
            for value in hash_values[num_gpu:]:
                if value not in host:
                    break
                num_host += 1
        return Match(num_gpu, num_host)

    def matched_blocks(self, replica: int, hash_values: list[int]) -> int:
        """How many of the prompt's leading blocks the replica holds, either tier (see match)."""
        return self.match(replica, hash_values).blocks

    def _score(self, replica: int, hash_values: list[int]) -> float:
        match = self.match(replica, hash_values)
        return match.gpu + self.host_weight * match.host

    def route(self, hash_values: list[int], exclude: frozenset[int] = frozenset()) -> Route:
        """Pick a replica for a prompt whose full blocks have these hash values (leading first)
        and count the request as in flight there (call finished(route) when its stream ends).
        Raises NoReplicaError when no live replica is left outside `exclude`."""
        live = [i for i, s in enumerate(self.replicas) if s.alive and i not in exclude]
        return self.record(self.pick(hash_values, live), hash_values)

    def record(self, choice: int, hash_values: list[int]) -> Route:
        """Count a request with these prompt blocks as sent to replica `choice` (in flight, its
        blocks pending there) until finished(route)."""
        match = self.match(choice, hash_values)
        state = self.replicas[choice]
        state.in_flight += 1
        state.routed += 1
        state.prompt_blocks += len(hash_values)
        state.matched_blocks += match.blocks
        state.host_matched_blocks += match.host
        pending = state.pending
        for value in hash_values:
            pending[value] = pending.get(value, 0) + 1
        return Route(choice, match.blocks, tuple(hash_values), match.host)

    def pick(self, hash_values: list[int], candidates: list[int], policy: str | None = None) -> int:
        """The policy's choice (this router's, or `policy`) among `candidates` (replica
        indices), counting nothing: route() does; a caller keeping its own counts, as Serve's
        router does, calls this alone."""
        if not candidates:
            raise NoReplicaError("no live data-parallel replica to take the request")
        policy = policy or self.policy
        if policy == "round_robin":
            return self._round_robin(candidates)
        if policy == "p2c":
            return self._p2c(candidates)
        return self._prefix(candidates, hash_values)

    def add_replica(self) -> int:
        """One more replica (Serve scaling up): its index."""
        self.replicas.append(ReplicaState())
        return len(self.replicas) - 1

    def _round_robin(self, live: list[int]) -> int:
        n = len(self.replicas)
        for step in range(n):
            index = (self._next + step) % n
            if index in live:
                self._next = index + 1
                return index
        raise AssertionError("unreachable: live is not empty")

    def _p2c(self, live: list[int]) -> int:
        if len(live) == 1:
            return live[0]
        a, b = self._rng.sample(live, 2)
        return a if self.replicas[a].load_score <= self.replicas[b].load_score else b

    def _prefix(self, live: list[int], hash_values: list[int]) -> int:
        replicas = self.replicas
        roomy = [i for i in live if replicas[i].kv_usage < self.kv_pressure] or live
        least = min(replicas[i].load_score for i in roomy)
        slack = self.balance_abs + self.balance_rel * least
        balanced = [i for i in roomy if replicas[i].load_score <= least + slack]
        return min(balanced, key=lambda i: (-self._score(i, hash_values), replicas[i].load_score, i))
