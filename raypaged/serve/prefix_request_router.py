"""Ray Serve's custom request router for raypaged replicas: the frontend's PrefixRouter
(frontend/prefix_router.py) choosing among a deployment's replicas.

What it sees of each replica comes from the replica's `record_routing_stats` (Serve polls it
every `request_routing_stats_period_s`, serve/app.py sets 1 s): the hash values its prefix cache
holds, on the GPU and in the host tier (cut to 64 bits: `routing_value`; a host block weighs
the router's `host_weight`), and its engine's load. Between polls, the router's own
count of requests routed to a replica and not yet answered, and their prompt blocks (pending
there), cover what the snapshot has not caught up with.

It is the router of the engine deployment (serve/engine_deployment.py), running in each
ingress replica's process for the ingress's handle calls. What it sees of a request: the
`core.Request` the ingress built (tokenized, its tenant's cache salt applied: the very values the
engine will hash), whatever the transport was (OpenAI HTTP or raypaged.v1 gRPC); a resumed stream
hashes its prompt and the tokens already streamed, as the engine will. Each call's `route`
keyword (serve/route_hint.py) narrows the candidates: the replicas its stream lost are avoided,
a pinned call (an abort) goes to its replica only. Every unpinned call also avoids the replicas
of the process-wide quarantine (serve/replica_quarantine.py: those whose engine is known dead,
until Serve's set drops them or they report a live engine again), which this router feeds from
the replicas' routing stats (`engine_alive`) and prunes as Serve's set changes. With no candidate
left it waits, in Serve's back-off, for a replica to come (the caller bounds the wait).

It also reads a raypaged.v1 GenerateRequest (a handle caller's own, or Serve's gRPC proxy's
pickled gRPCRequest, should the router be set on a deployment the proxy calls); a text prompt is
then tokenized with the model's tokenizer. A call whose prompt it cannot read is placed by load
(power of two choices over the same loads).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any

from ray.serve._private.common import gRPCRequest  # what Serve's gRPC proxy sends a replica
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from raypaged.core.block_hashing import block_hasher, prefix_hash_values
from raypaged.core.outputs import EngineLoad
from raypaged.core.request import Request
from raypaged.frontend.prefix_router import PrefixRouter, ReplicaState
from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.serve.replica_quarantine import ReplicaQuarantine, process_quarantine
from raypaged.serve.route_hint import RouteHint

logger = logging.getLogger(__name__)

_MASK_64 = (1 << 64) - 1


def routing_value(hash_value: int) -> int:
    """A block hash as the routing stats carry it (64 bits: a hint, not a cache key)."""
    return hash_value & _MASK_64


class _ServeRequestUnpickler(pickle.Unpickler):
    """Unpickles what Serve's gRPC proxy pickled — its gRPCRequest around the client's parsed
    message — and refuses every other class, so bytes that are not the proxy's cannot run code
    here (the replica unpickles the same bytes with Ray's own unpickler)."""

    ALLOWED_PREFIXES = ("ray.serve.", "raypaged.proto.", "google.protobuf.")

    def find_class(self, module: str, name: str) -> Any:
        if not module.startswith(self.ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"{module}.{name} is not a Serve request")
        return super().find_class(module, name)


def generate_request_of(pending: PendingRequest) -> pb.GenerateRequest | None:
    """The GenerateRequest among the request's arguments: a handle caller's own, or the one
    Serve's gRPC proxy sends (a gRPCRequest, pickled by the proxy itself, as the replica will
    unpickle it)."""
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, bytes):
            try:
                arg = _ServeRequestUnpickler(io.BytesIO(arg)).load()
            except Exception:  # noqa: BLE001 - not the proxy's: placed by load
                continue
        message = arg.user_request_proto if isinstance(arg, gRPCRequest) else arg
        if isinstance(message, pb.GenerateRequest):
            return message
    return None


def core_request_of(pending: PendingRequest) -> Request | None:
    """The core Request among the call's arguments (the ingress's generate calls)."""
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, Request):
            return arg
    return None


def route_hint_of(pending: PendingRequest | None) -> RouteHint:
    hint = pending.kwargs.get("route") if pending is not None else None
    return hint if isinstance(hint, RouteHint) else RouteHint()


def routing_stats(state: ReplicaState, engine_alive: bool = True) -> dict[str, Any]:
    """A replica's view of its own engine (its cache events replayed into `state`) as its
    record_routing_stats sends it: both tiers' hash values, the engine's load, and whether the
    engine lives (a replica whose engine died is held out of routing, serve/replica_quarantine.py)."""
    load = state.load or EngineLoad(0, 0, 0.0)
    return {"cached": [routing_value(v) for v in state.cached],
            "host_cached": [routing_value(v) for v in state.host_cached],
            "num_waiting": load.num_waiting, "num_running": load.num_running, "kv_usage": load.kv_usage,
            "engine_alive": engine_alive}


def apply_routing_stats(state: ReplicaState, stats: dict[str, Any]) -> None:
    """A replica's snapshot (`routing_stats`, sent by serve/engine_deployment.py) into the router's
    view (a snapshot without a key leaves that part as it was)."""
    if "cached" in stats:
        state.cached = set(stats["cached"])
    if "host_cached" in stats:
        state.host_cached = set(stats["host_cached"])
    if "num_waiting" in stats:
        state.load = EngineLoad(stats["num_waiting"], stats.get("num_running", 0), stats.get("kv_usage", 0.0))


class PrefixAwareRequestRouter(RequestRouter):
    """Not FIFOMixin's: the replica chosen for a call is that call's (a pinned abort must reach
    its replica, not whichever call waits longest)."""

    def initialize_state(self, block_size: int = 16, policy: str = "prefix", tokenizer: str | None = None,
                         **router_kwargs: Any) -> None:
        """Serve calls this with request_router_kwargs (serve/app.py): the engines' block size,
        the policy, the tokenizer's directory (None: text prompts are placed by load only)."""
        self._block_size = block_size
        self._tokenizer_dir = tokenizer
        self._tokenizer: Any = None
        self._hasher = block_hasher("sha256")
        self._router = PrefixRouter(1, policy, **router_kwargs)
        self._router.mark_dead(0)  # indices are handed out as Serve names replicas
        self._indices: dict[ReplicaID, int] = {}
        self._stats_seen: dict[ReplicaID, int] = {}
        self.quarantine: ReplicaQuarantine = process_quarantine()
        self.num_held_out = 0  # times a quarantined replica was left out of a call's candidates

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id, index in self._indices.items():
            if replica_id not in current:
                self._router.mark_dead(index)
        for replica_id in current - self._indices.keys():
            self._indices[replica_id] = self._router.add_replica()
        # Serve sends the set again as replicas' routing stats change: a replica whose engine
        # died is held here, before any call has to choose.
        for replica in replicas:
            self._refresh(self._indices[replica.replica_id], replica)
        self.quarantine.retain((r.unique_id for r in self._indices), (r.unique_id for r in current))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.quarantine.hold(replica_id.unique_id, "its actor died")
        if replica_id in self._indices:
            self._router.mark_dead(self._indices[replica_id])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = route_hint_of(pending_request)
        if pending_request is not None:
            # Serve asks again at once unless told to back off; an empty answer (every replica
            # avoided) would spin its routing loop without ever yielding the event loop.
            pending_request.routing_context.should_backoff = True
        by_index: dict[int, RunningReplica] = {}
        for replica in candidate_replicas:
            index = self._indices.get(replica.replica_id)
            if index is None:
                index = self._indices[replica.replica_id] = self._router.add_replica()
            # Every candidate's stats, avoided or not: a held replica is released by them.
            self._refresh(index, replica)
            unique_id = replica.replica_id.unique_id
            if not hint.allows(unique_id):
                continue
            if hint.pin is None and unique_id in self.quarantine:
                self.num_held_out += 1
                continue
            by_index[index] = replica
        if not by_index:
            return []  # Serve backs off and asks again as replicas come and go
        values = self._hash_values(pending_request)
        # A request whose prompt it cannot read: by load alone (power of two choices).
        choice = self._router.pick(values, sorted(by_index), None if values else "p2c")
        rest = [r for i, r in by_index.items() if i != choice]
        return [[by_index[choice]], rest] if rest else [[by_index[choice]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        index = self._indices.get(replica_id)
        if index is None:
            return
        route = self._router.record(index, self._hash_values(pending_request))
        result.add_done_callback(lambda _: self._router.finished(route))

    # ---- helpers ----------------------------------------------------------------------------------
    def _refresh(self, index: int, replica: RunningReplica) -> None:
        state = self._router.replicas[index]
        state.alive = True
        stats = replica.routing_stats
        if stats and self._stats_seen.get(replica.replica_id) != id(stats):
            self._stats_seen[replica.replica_id] = id(stats)
            apply_routing_stats(state, stats)
            self.quarantine.note_stats(replica.replica_id.unique_id, bool(stats.get("engine_alive", True)))

    def _hash_values(self, pending: PendingRequest | None) -> list[int]:
        if pending is None:
            return []
        request = core_request_of(pending)
        if request is not None:
            ids = [*request.prompt_token_ids, *request.resumed_output_token_ids]
            values = prefix_hash_values(ids, self._block_size, request.cache_salt, self._hasher)
            return [routing_value(v) for v in values]
        message = generate_request_of(pending)
        if message is None:
            return []
        ids = list(message.prompt_token_ids)
        if not ids and message.prompt:
            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                return []
            ids = tokenizer.encode(message.prompt)
        values = prefix_hash_values(ids, self._block_size, message.cache_salt or None, self._hasher)
        return [routing_value(v) for v in values]

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None and self._tokenizer_dir is not None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
            except Exception:  # noqa: BLE001 - placed by load only, never failed for it
                logger.exception("prefix router: cannot load the tokenizer %s", self._tokenizer_dir)
                self._tokenizer_dir = None
        return self._tokenizer
