"""Ray Serve's custom request router for raypaged replicas: the frontend's PrefixRouter
(frontend/prefix_router.py) choosing among a deployment's replicas.

What it sees of each replica comes from the replica's `record_routing_stats` (Serve polls it
every `request_routing_stats_period_s`, serve/app.py sets 1 s): the hash values its prefix cache
holds (cut to 64 bits: `routing_value`) and its engine's load. Between polls, the router's own
count of requests routed to a replica and not yet answered, and their prompt blocks (pending
there), cover what the snapshot has not caught up with.

What it sees of a request: a raypaged.v1 GenerateRequest, as Serve's gRPC proxy passes it (a
pickled gRPCRequest) or as a DeploymentHandle caller passes it. Its prompt is hashed with core's chain;
a text prompt is tokenized with the model's tokenizer, as the replica will. Serve's HTTP proxy
routes before the body is read (the router gets the ASGI scope alone), so OpenAI HTTP requests
through it are placed by load only (power of two choices over the same loads).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any

from ray.serve._private.common import gRPCRequest  # what Serve's gRPC proxy sends a replica
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from raypaged.core.block_hashing import block_hasher, prefix_hash_values
from raypaged.core.outputs import EngineLoad
from raypaged.frontend.prefix_router import PrefixRouter, ReplicaState
from raypaged.proto.v1 import raypaged_pb2 as pb

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


def apply_routing_stats(state: ReplicaState, stats: dict[str, Any]) -> None:
    """A replica's snapshot (serve/deployment.py record_routing_stats) into the router's view."""
    if "cached" in stats:
        state.cached = set(stats["cached"])
    if "num_waiting" in stats:
        state.load = EngineLoad(stats["num_waiting"], stats.get("num_running", 0), stats.get("kv_usage", 0.0))


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
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

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id, index in self._indices.items():
            if replica_id not in current:
                self._router.mark_dead(index)
        for replica_id in current - self._indices.keys():
            self._indices[replica_id] = self._router.add_replica()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if replica_id in self._indices:
            self._router.mark_dead(self._indices[replica_id])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_index: dict[int, RunningReplica] = {}
        for replica in candidate_replicas:
            index = self._indices.get(replica.replica_id)
            if index is None:
                index = self._indices[replica.replica_id] = self._router.add_replica()
            self._refresh(index, replica)
            by_index[index] = replica
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

    def _hash_values(self, pending: PendingRequest | None) -> list[int]:
        message = generate_request_of(pending) if pending is not None else None
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
