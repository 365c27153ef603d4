"""CallIdentities: each engine-pool handle call runs under a Serve request context of its own
(a fresh internal request id), the client's request id kept and the caller's context untouched.
Without Ray: the context Serve's handle would read is the one the call sees."""

from __future__ import annotations

import contextvars

from ray.serve import context as serve_context

from raypaged.serve.call_identity import CallIdentities


def _seen() -> serve_context._RequestContext:
    """What a handle's `.remote` reads when it builds the call's metadata."""
    return serve_context._get_serve_request_context()


def _in_client_request() -> tuple[list[serve_context._RequestContext], serve_context._RequestContext]:
    serve_context._serve_request_context.set(serve_context._RequestContext(  # type: ignore[arg-type]
        route="/v1", request_id="client-42", _internal_request_id="proxy-7", app_name="raypaged",
        cancel_on_parent_request_cancel=True))
    identities = CallIdentities()
    calls = [identities.call("req#0", _seen), identities.call("req#1", _seen), identities.call("req", _seen)]
    return calls, _seen()


def test_every_call_has_its_own_internal_id_and_keeps_the_clients_request_id():
    calls, after = contextvars.copy_context().run(_in_client_request)
    ids = [c._internal_request_id for c in calls]
    assert len(set(ids)) == 3 and "proxy-7" not in ids
    assert all(i.startswith("proxy-7/") for i in ids)  # each names the client request it serves
    assert [i.split("/")[1] for i in ids] == ["req#0", "req#1", "req"]
    assert all(c.request_id == "client-42" and c.route == "/v1" and c.app_name == "raypaged"
               and c.cancel_on_parent_request_cancel for c in calls)
    assert after._internal_request_id == "proxy-7"  # the caller's context is as it was


def test_arguments_pass_through_and_a_call_outside_any_request_gets_an_id_too():
    def remote(*args, **kwargs):
        return args, kwargs, _seen()._internal_request_id

    args, kwargs, internal = contextvars.copy_context().run(
        CallIdentities().call, "req", remote, 1, "x", route="hint")
    assert (args, kwargs) == ((1, "x"), {"route": "hint"})
    assert internal.startswith("pool/req/")
