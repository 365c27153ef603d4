"""RouteHint: what the ingress tells the engine deployment's request router about one call.

The ingress (serve/deployment.py) reaches the engine replicas through a DeploymentHandle, whose
router (serve/prefix_request_router.py) runs in the ingress's process and picks a replica per
call. Two things only the caller knows go with the call as its `route` keyword:

- avoid: the replicas this stream already lost (their actor died, or their engine did). Serve's
  controller notices a dead replica a moment later than the stream that lost it; until then the
  replica is still a candidate, and a retry must not land there.
- pin: the one replica the call is for: an abort, or a stats read, reaches the replica that
  streams the request (or whose numbers a test reads), not one picked by load.

Replicas are named by Serve's unique replica id (`ReplicaID.unique_id`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouteHint:
    avoid: frozenset[str] = frozenset()
    pin: str | None = None

    def allows(self, replica: str) -> bool:
        if self.pin is not None:
            return replica == self.pin
        return replica not in self.avoid
