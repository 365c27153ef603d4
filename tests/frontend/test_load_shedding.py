"""The front door's shedding decision on its own (frontend/load_shedding.py): each measure, the
counts an admission holds and gives back, and Retry-After, fixed or estimated."""

from __future__ import annotations

import pytest

from raypaged.config import SERVING_MAX_WAITING_REQUESTS, ConfigError, EngineConfig
from raypaged.core.errors import QueueFullError
from raypaged.core.outputs import EngineLoad
from raypaged.frontend.load_shedding import LoadShedder, OverloadPolicy, ShedError

IDLE = EngineLoad(num_waiting=0, num_running=0, kv_usage=0.0)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_default_policy_sheds_nothing():
    shedder = LoadShedder(OverloadPolicy())
    full = EngineLoad(num_waiting=10_000, num_running=256, kv_usage=1.0)
    admissions = [shedder.admit(4000, full) for _ in range(5000)]
    assert shedder.num_waiting == 5000
    for admission in admissions:
        admission.close(completed=False)
    assert (shedder.num_waiting, shedder.num_waiting_tokens) == (0, 0)


def test_waiting_requests_bound_and_admissions_give_their_place_back():
    shedder = LoadShedder(OverloadPolicy(max_waiting_requests=2))
    first, second = shedder.admit(5, IDLE), shedder.admit(5, IDLE)
    with pytest.raises(ShedError) as shed:
        shedder.admit(5, IDLE)
    assert shed.value.reason == "waiting_requests" and isinstance(shed.value, QueueFullError)
    with pytest.raises(ShedError):
        shedder.check(IDLE)  # before tokenizing: the count alone decides
    assert shedder.num_waiting == 2  # the refused one counted nothing
    first.first_output()
    first.first_output()  # idempotent
    third = shedder.admit(5, IDLE)
    second.close(completed=True)
    first.close(completed=True)  # after first_output: gives nothing back twice
    assert (shedder.num_waiting, shedder.num_waiting_tokens) == (1, 5)
    third.close(completed=False)
    assert (shedder.num_waiting, shedder.num_waiting_tokens) == (0, 0)


def test_waiting_tokens_bound_lets_a_lone_request_through():
    shedder = LoadShedder(OverloadPolicy(max_waiting_tokens=100))
    big = shedder.admit(500, IDLE)  # alone in the queue: above the bound, still served
    with pytest.raises(ShedError) as shed:
        shedder.admit(1, IDLE)
    assert shed.value.reason == "waiting_tokens"
    shedder.check(IDLE)  # the tokens' measure needs the prompt: not checked before it
    big.first_output()
    a = shedder.admit(60, IDLE)
    shedder.admit(40, IDLE)  # 100: at the bound is fine
    with pytest.raises(ShedError):
        shedder.admit(1, IDLE)
    a.first_output()
    shedder.admit(60, IDLE)


def test_kv_pressure_sheds_only_while_requests_wait():
    shedder = LoadShedder(OverloadPolicy(shed_kv_usage=0.9))
    full = EngineLoad(num_waiting=0, num_running=4, kv_usage=0.95)
    waiting = shedder.admit(8, full)  # nothing waits yet: the pool frees as requests finish
    with pytest.raises(ShedError) as shed:
        shedder.admit(8, full)
    assert shed.value.reason == "kv_cache" and "95%" in str(shed.value)
    waiting.first_output()
    shedder.admit(8, EngineLoad(num_waiting=0, num_running=4, kv_usage=0.5))
    with pytest.raises(ShedError):  # the engine's own queue counts too
        LoadShedder(OverloadPolicy(shed_kv_usage=0.9)).check(EngineLoad(3, 4, 0.9))
    LoadShedder(OverloadPolicy(shed_kv_usage=0.9)).check(None)  # no snapshot yet: admit


def test_retry_after_fixed_or_estimated_from_the_completion_rate():
    assert LoadShedder(OverloadPolicy(retry_after_s=7.0)).retry_after_s() == 7.0
    clock = _Clock()
    shedder = LoadShedder(OverloadPolicy(max_waiting_requests=40), clock=clock)
    assert shedder.retry_after_s() == 1.0  # nothing completed yet
    for _ in range(10):  # 10 completions over 10 s: 1 per second
        shedder.admit(1, IDLE).close(completed=True)
        clock.now += 1.0
    for _ in range(40):
        shedder.admit(1, IDLE)
    with pytest.raises(ShedError) as shed:
        shedder.admit(1, IDLE)
    assert shed.value.retry_after_s == 40.0  # 40 waiting at 1 per second
    clock.now += 1000.0  # the window holds no completion any more
    assert shedder.retry_after_s() == 1.0
    for _ in range(100):
        shedder._completed()
    clock.now += 1.0
    assert shedder.retry_after_s() == 1.0  # fast drain: at least 1 s


def test_policy_from_the_engine_settings():
    config = EngineConfig(max_waiting_requests=SERVING_MAX_WAITING_REQUESTS, max_waiting_tokens=4096,
                          shed_kv_usage=0.95, request_timeout_s=30.0)
    config.validate()
    assert OverloadPolicy.from_config(config) == OverloadPolicy(
        max_waiting_requests=SERVING_MAX_WAITING_REQUESTS, max_waiting_tokens=4096, shed_kv_usage=0.95,
        retry_after_s=None, request_timeout_s=30.0)
    for bad in (dict(shed_kv_usage=1.5), dict(max_waiting_tokens=0), dict(request_timeout_s=0.0),
                dict(retry_after_s=-1.0)):
        with pytest.raises(ConfigError):
            EngineConfig(**bad).validate()


def test_flags_reach_the_policy():
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--max-waiting-requests", "8", "--max-waiting-tokens", "512",
                              "--shed-kv-usage", "0.9", "--retry-after-s", "2", "--request-timeout-s", "30"])
    assert OverloadPolicy.from_config(EngineConfig.from_cli_args(args)) == OverloadPolicy(
        max_waiting_requests=8, max_waiting_tokens=512, shed_kv_usage=0.9, retry_after_s=2.0,
        request_timeout_s=30.0)
    assert OverloadPolicy.from_config(EngineConfig.from_cli_args(parser.parse_args([]))) == OverloadPolicy()
