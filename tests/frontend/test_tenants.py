"""API keys as tenants: the keys file (frontend/keys_file.py), the registry and what a tenant does
to its requests (frontend/tenants.py), and the door's part with its metrics
(frontend/tenant_door.py). Pure: no server."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams
from raypaged.frontend.keys_file import KeysFileError, load_keys_file, parse_keys
from raypaged.frontend.metrics import FrontendMetrics
from raypaged.frontend.rate_limit import TenantLimitError
from raypaged.frontend.tenant_door import TenantDoor
from raypaged.frontend.tenants import (
    NAME_PATTERN,
    Tenant,
    TenantLimits,
    TenantRegistry,
    unused_priorities_warning,
)

KEY_A = "sk-team-a-3f9c1e7d5b2a4c6e"
KEY_B = "sk-batch-0d8e2f4a6c1b3e5d"
GOOD = f"""
# two tenants
keys:
  "{KEY_A}":
    name: team-a
    requests_per_second: 5
    burst: 10
    tokens_per_minute: 200000
    max_concurrent: 8
  {KEY_B}:
    name: batch
    priority: 10
"""


def test_keys_file_reads_each_key_as_a_tenant(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(GOOD)
    registry = load_keys_file(str(path))
    assert len(registry) == 2 and registry.uses_priorities
    team_a = registry.authenticate(f"Bearer {KEY_A}")
    assert team_a == Tenant("team-a", TenantLimits(5.0, 10, 200000, 8), 0)
    assert registry.authenticate(f"Bearer {KEY_B}".encode()) == Tenant("batch", TenantLimits(), 10)


def test_a_json_file_reads_the_same():
    as_json = json.dumps({"keys": {KEY_A: {"name": "team-a", "requests_per_second": 5, "burst": 10,
                                            "tokens_per_minute": 200000, "max_concurrent": 8},
                                    KEY_B: {"name": "batch", "priority": 10}}}, indent=2)
    assert parse_keys(as_json).tenants == parse_keys(GOOD).tenants


@pytest.mark.parametrize("text, message", [
    ("", "the file is empty"),
    ("keys: [\n", "line 2: not valid YAML"),
    ("- a\n", "line 1: the file must be a mapping"),
    ("tenants: {}\n", "line 1: unknown top-level field 'tenants'"),
    ("keys: {}\n", "line 1: keys: no key is given"),
    ("keys:\n  short-key:\n    name: a\n", "line 2: keys: an API key must have at least 16 characters"),
    (f"keys:\n  {KEY_A}:\n    priority: 1\n", "line 3: name: every key needs a name"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    rps: 3\n", "line 4: unknown field 'rps'"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    max_concurrent: 0\n", "line 4: max_concurrent: must be >= 1"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    requests_per_second: fast\n",
     "line 4: requests_per_second: must be a number, got 'fast'"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    requests_per_second: 0\n", "line 4: requests_per_second: must be > 0"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    tokens_per_minute: 1.5\n", "line 4: tokens_per_minute: must be an integer"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    priority: true\n", "line 4: priority: must be an integer, got True"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    burst: 4\n", "line 4: burst: needs requests_per_second"),
    (f"keys:\n  {KEY_A}:\n    name: a b\n", "line 3: name: a tenant name must match"),
    (f"keys:\n  {KEY_A}:\n    name: 7\n", "line 3: name: must be a string"),
    (f"keys:\n  {KEY_A}:\n    name: a\n    name: b\n",
     "line 4: a key's entry: 'name' is given twice (first at line 3)"),
    (f"keys:\n  {KEY_A}:\n    name: a\n  {KEY_B}:\n    name: a\n",
     "line 5: name: 'a' is already the name of the key at line 3"),
    (f"keys:\n  {KEY_A}:\n    name: a\n  {KEY_A}:\n    name: b\n",
     "line 4: keys: the same API key is given twice (first at line 2)"),
])
def test_a_malformed_keys_file_names_the_line_and_the_field(text, message):
    with pytest.raises(KeysFileError) as error:
        parse_keys(text, "keys.yaml")
    assert str(error.value).startswith("keys.yaml"), error.value
    assert message in str(error.value), error.value
    assert KEY_A not in str(error.value) and KEY_B not in str(error.value)  # never a key in a message


def test_a_file_others_may_read_is_warned_about(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(GOOD)
    path.chmod(0o600)
    load_keys_file(str(path))
    assert "other users" not in caplog.text
    path.chmod(0o644)
    load_keys_file(str(path))
    assert "may be read by other users" in caplog.text


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read the API keys file"):
        load_keys_file(str(tmp_path / "nope.yaml"))


def test_the_launch_option_fails_at_start_on_a_bad_file(tmp_path):
    import argparse

    from raypaged.commands.network_security import security_from_args

    def security_args(**options: str) -> argparse.Namespace:
        return argparse.Namespace(**{**dict(tls_cert=None, tls_key=None, tls_client_ca=None, auth_token=None,
                                            api_keys_file=None, max_message_bytes=4 * 2**20), **options})

    bad = tmp_path / "keys.yaml"
    bad.write_text(f"keys:\n  {KEY_A}:\n    name: a\n    max_concurrent: -1\n")
    with pytest.raises(ValueError, match="keys.yaml line 4: max_concurrent"):
        security_from_args(security_args(api_keys_file=str(bad)))
    bad.write_text(GOOD)
    with pytest.raises(ValueError, match="given twice"):  # the token must not be a key of the file too
        security_from_args(security_args(api_keys_file=str(bad), auth_token=KEY_A))
    security = security_from_args(security_args(api_keys_file=str(bad), auth_token="another-token-of-the-test"))
    assert security.authenticates and len(security.api_keys or ()) == 2


def test_the_serve_app_checks_its_keys_file_at_deploy_time(tmp_path):
    from raypaged.config import ConfigError
    from raypaged.serve.args import ServeAppArgs

    bad = tmp_path / "keys.yaml"
    bad.write_text(f"keys:\n  {KEY_A}:\n    nme: a\n")
    with pytest.raises(ConfigError, match="line 3: unknown field 'nme'"):
        ServeAppArgs.from_dict({"api_keys_file": str(bad)})
    bad.write_text(GOOD)
    assert len(ServeAppArgs.from_dict({"api_keys_file": str(bad)}).api_keys() or ()) == 2


def test_registry_authenticates_bearer_values_only():
    registry = TenantRegistry.merge((parse_keys(GOOD), TenantRegistry.single("the-single-token-0001")))
    assert registry is not None and len(registry) == 3
    assert registry.authenticate("Bearer the-single-token-0001") == Tenant("default")
    for value in (None, "", KEY_A, f"bearer {KEY_A}", f"Bearer {KEY_A} ", f"Bearer {KEY_A}x", "Bearer "):
        assert registry.authenticate(value) is None, value
    assert registry.from_metadata([("authorization", f"Bearer {KEY_A}")]).name == "team-a"
    two = [("authorization", f"Bearer {KEY_A}"), ("authorization", f"Bearer {KEY_A}")]
    assert registry.from_metadata(two) is None and registry.from_metadata(None) is None
    with pytest.raises(ValueError, match="given twice"):
        TenantRegistry.merge((parse_keys(GOOD), parse_keys(GOOD)))
    assert TenantRegistry.merge((None, None)) is None


names = st.from_regex(NAME_PATTERN, fullmatch=True)
salts = st.one_of(st.none(), st.text(max_size=12))


@settings(deadline=None)  # a loaded machine is slow, not wrong
@given(a=names, b=names, salt_a=salts, salt_b=salts)
def test_two_tenants_never_share_a_cache_salt(a, b, salt_a, salt_b):
    """Whatever salts their clients send, different tenants' requests hash under different salts;
    the same tenant with the same salt, under the same."""
    same = Tenant(a).cache_salt(salt_a) == Tenant(b).cache_salt(salt_b)
    assert same == (a == b and (salt_a or "") == (salt_b or ""))


@settings(deadline=None)
@given(own=st.integers(-100, 100), asked=st.integers(-1000, 1000))
def test_a_request_never_gets_ahead_of_its_keys_priority(own, asked):
    priority = Tenant("t", priority=own).priority_for(asked)
    assert priority >= own  # lower is earlier: never earlier than the key's
    assert priority == (own if asked == 0 else max(own, asked))


def test_door_applies_salt_and_priority_and_counts_per_tenant():
    clock = [0.0]
    metrics = FrontendMetrics("m", 64)
    door = TenantDoor(lambda: metrics, clock=lambda: clock[0])
    tenant = Tenant("team-a", TenantLimits(max_concurrent=1), priority=3)
    request = Request("r", [1, 2, 3], SamplingParams(), priority=0, cache_salt="mine")
    door.apply(tenant, request)
    assert (request.cache_salt, request.priority) == (tenant.cache_salt("mine"), 3)
    door.check(tenant)
    admitted = door.admit(tenant, 3)
    admitted.on_tokens(4)
    with pytest.raises(TenantLimitError):
        door.admit(tenant, 3)
    door.refused(tenant, "waiting_requests")  # the shedder's refusal of this tenant's request

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", "tenant": "team-a",
                                                        **labels})

    assert value("raypaged_tenant_requests_total") == 1
    assert value("raypaged_tenant_prompt_tokens_total") == 3
    assert value("raypaged_tenant_generation_tokens_total") == 4
    assert value("raypaged_tenant_requests_refused_total", reason="max_concurrent") == 1
    assert value("raypaged_tenant_requests_refused_total", reason="waiting_requests") == 1
    assert value("raypaged_tenant_requests_in_flight") == 1
    admitted.close()
    admitted.close()
    assert value("raypaged_tenant_requests_in_flight") == 0
    door.admit(tenant, 3).close()
    # Without a tenant nothing changes and nothing is counted.
    plain = Request("p", [1], SamplingParams(), cache_salt="x")
    door.apply(None, plain)
    door.check(None)
    door.admit(None, 1).close()
    assert (plain.cache_salt, plain.priority) == ("x", 0)


def test_priorities_under_fcfs_are_warned_about():
    registry = parse_keys(GOOD)  # batch has priority 10
    assert "order nothing" in (unused_priorities_warning(registry, "fcfs") or "")
    assert unused_priorities_warning(registry, "priority") is None
    assert unused_priorities_warning(TenantRegistry.single("the-single-token-0001"), "fcfs") is None
    assert unused_priorities_warning(None, "fcfs") is None
