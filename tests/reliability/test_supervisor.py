"""EngineSupervisor's policy without Ray: the old engine is retired first, failed starts back off
exponentially up to a cap, a crash loop keeps backing off while a healthy run starts afresh,
max_attempts gives up, and a server stopping mid-start leaves no engine behind."""

from __future__ import annotations

import asyncio

import pytest

from raypaged.frontend import supervisor as supervisor_module
from raypaged.frontend.supervisor import EngineSupervisor, RestartPolicy


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name = name
        self.shutdowns = 0

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        self.shutdowns += 1


class Factory:
    """Fails `failures` times, then makes engines."""

    def __init__(self, failures: int = 0, start_s: float = 0.0) -> None:
        self.failures = failures
        self.start_s = start_s
        self.calls = 0
        self.made: list[FakeEngine] = []

    async def __call__(self) -> FakeEngine:
        self.calls += 1
        await asyncio.sleep(self.start_s)
        if self.calls <= self.failures:
            raise RuntimeError(f"no resources ({self.calls})")
        engine = FakeEngine(f"engine{self.calls}")
        self.made.append(engine)
        return engine


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The backoff delays asked for (slept for real only as a yield)."""
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args) -> None:
        if delay > 0:
            delays.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(supervisor_module.asyncio, "sleep", sleep)
    return delays


def test_retires_the_dead_engine_then_backs_off_until_one_starts(sleeps):
    factory = Factory(failures=4)
    supervisor = EngineSupervisor(factory, RestartPolicy(initial_backoff_s=1, max_backoff_s=5))
    dead = FakeEngine("dead")
    new = asyncio.run(supervisor.replace(dead))
    assert dead.shutdowns == 1
    assert new is factory.made[0] and factory.calls == 5
    assert sleeps == [1, 2, 4, 5]  # the first attempt at once, then doubling up to the cap
    assert supervisor.num_restarts == 1 and supervisor.num_failed_attempts == 4


def test_a_crash_loop_keeps_backing_off_a_healthy_run_starts_afresh(sleeps, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(supervisor_module.time, "monotonic", lambda: clock[0])
    supervisor = EngineSupervisor(Factory(), RestartPolicy(initial_backoff_s=1, max_backoff_s=8,
                                                           stable_after_s=60))
    for _ in range(4):  # each new engine dies within seconds
        clock[0] += 5
        asyncio.run(supervisor.replace(FakeEngine("dead")))
    assert sleeps == [1, 2, 4]
    clock[0] += 61  # this one ran long enough to count as healthy
    asyncio.run(supervisor.replace(FakeEngine("dead")))
    assert sleeps == [1, 2, 4]  # restarted at once
    assert supervisor.num_restarts == 5


def test_gives_up_after_max_attempts(sleeps):
    factory = Factory(failures=10)
    supervisor = EngineSupervisor(factory, RestartPolicy(initial_backoff_s=0.5, max_attempts=3))
    assert asyncio.run(supervisor.replace(FakeEngine("dead"))) is None
    assert factory.calls == 3 and supervisor.num_failed_attempts == 3 and supervisor.num_restarts == 0


def test_cancelled_mid_start_shuts_the_new_engine_down():
    factory = Factory(start_s=0.2)
    supervisor = EngineSupervisor(factory)

    async def cancel_during_start() -> None:
        task = asyncio.ensure_future(supervisor.replace(FakeEngine("dead")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_during_start())
    assert len(factory.made) == 1 and factory.made[0].shutdowns == 1


@pytest.mark.parametrize("kwargs", [dict(initial_backoff_s=5, max_backoff_s=1), dict(initial_backoff_s=-1),
                                    dict(max_attempts=0)])
def test_bad_policy(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
