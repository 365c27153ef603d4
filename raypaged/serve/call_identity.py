"""CallIdentities: every DeploymentHandle call of the engine pool is a Serve request of its own.

A handle call made while a replica serves a request inherits that request's Serve context
(`ray.serve.context`), its internal request id included: the ingress's calls to the engine
replicas all carry the id the proxy gave the client's request. Serve's request router keys the
calls waiting for a replica by that id (its pending-request index keeps one entry per id, the
first; a later call under the same id waits unindexed and is never assigned), so two calls of
one client request in flight at once collide: the samples of an n > 1 stream resumed on another
replica (one call each, at once), an abort sent while its stream's call still waits. The second
call waits for a replica until the pool's recovery bound and the stream ends UNAVAILABLE.

So each call runs under a copy of the caller's context whose internal request id is the call's
own: `<the client's internal id>/<engine request id>/<n>`, n counting the pool's calls, which
names the client request it serves (in Serve's logs and here) and is unique per ingress
replica's pool. The client-facing request id (`x-request-id`, the access logs' id) stays the
client's. What this gives up: Serve no longer links the call to the client's request for its
own cancellation of child calls; the pool cancels each call itself when its stream ends
(serve/engine_pool.py), a client that goes away included.

Serve's request context is private API (ray.serve.context, checked against Ray 2.60): this
module is the one place that touches it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ray.serve import context as serve_context

T = TypeVar("T")


class CallIdentities:
    """Issues the internal request ids of one pool's handle calls and makes the calls under them."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def call_id(self, parent: str, request_id: str) -> str:
        """A fresh internal id for a call serving engine request `request_id` within the client
        request whose internal id is `parent` ("" outside any request: a test, a driver)."""
        return f"{parent or 'pool'}/{request_id}/{next(self._count)}"

    def call(self, request_id: str, remote: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`remote(*args, **kwargs)` (a handle method's `.remote`) under the caller's Serve
        context with a fresh internal request id; the caller's own context is left as it was.
        Serve reads the context when the call is made, and its router's tasks copy it there."""
        parent = serve_context._get_serve_request_context()
        own = dataclasses.replace(parent, _internal_request_id=self.call_id(parent._internal_request_id, request_id))

        def in_own_context() -> T:
            # Typed ContextVar[None] by its None default; it holds a _RequestContext.
            cast("contextvars.ContextVar[Any]", serve_context._serve_request_context).set(own)
            return remote(*args, **kwargs)

        return contextvars.copy_context().run(in_own_context)
