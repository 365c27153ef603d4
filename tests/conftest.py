import os

# Triton kernels run in the interpreter on machines without a GPU. Must be set before triton
# is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Every Ray a test starts is its own: a bare ray.init() (and the servers the tests launch, which
# inherit this) would otherwise join whatever cluster `ray start` or another test run left on
# the host, and fail there. An explicit address (a test's own multi-node cluster) still wins.
os.environ.setdefault("RAY_ADDRESS", "local")

import contextlib
import multiprocessing.process
import subprocess
import sys
from collections.abc import Iterator
from unittest import mock

import pytest

# Markers a run leaves out unless its -m expression names them: `pytest -m "not integration"`
# (the inner loop) must not pull the slow or GPU suites in by replacing the default expression.
_OPT_IN_MARKERS = ("slow", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    expression = config.getoption("markexpr") or ""
    left_out = [m for m in _OPT_IN_MARKERS if m not in expression]
    kept, deselected = [], []
    for item in items:
        (deselected if any(item.get_closest_marker(m) for m in left_out) else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@contextlib.contextmanager
def _refusing_processes_and_servers(nodeid: str) -> Iterator[None]:
    """A test not marked `integration` may start no Ray, no gRPC server and no process: the
    inner loop (`-m "not integration"`) stays fast and in one process, and a test that does one
    of these unmarked fails here, saying so, instead of slowing that loop down."""

    def refuse(what: str):
        def refused(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{nodeid} {what}: mark it @pytest.mark.integration")
        return refused

    import grpc
    import ray

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(ray, "init", refuse("starts Ray")))
        stack.enter_context(mock.patch.object(grpc, "server", refuse("starts a gRPC server")))
        stack.enter_context(mock.patch.object(grpc.aio, "server", refuse("starts a gRPC server")))
        stack.enter_context(mock.patch.object(subprocess.Popen, "__init__", refuse("starts a process")))
        stack.enter_context(mock.patch.object(multiprocessing.process.BaseProcess, "start",
                                              refuse("starts a process")))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if item.get_closest_marker("integration") or item.get_closest_marker("gpu"):
        yield
        return
    with _refusing_processes_and_servers(item.nodeid):
        yield

@pytest.fixture(scope="module", autouse=True)
def _ray_left_by_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """One Ray instance per test module: a module that leaves Ray connected in this process
    (a driver a harness joined and never left) would fail every later module's ray.init with
    "called ray.init twice". Shut it down here, and say which module left it; a Ray that a
    package-scoped fixture holds (tests/serve/conftest.py) is that fixture's to shut down."""
    yield
    from tests.support.ray_state import is_held_across_modules

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not is_held_across_modules():
        import warnings

        ray.shutdown()
        warnings.warn(f"{request.node.nodeid} left Ray initialized; shut down after it", stacklevel=1)


_exit_status: int | None = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Leave with pytest's status once its summary is out, skipping the interpreter's teardown:
    # native extensions the suite loads (Triton's MLIR bindings, which report leaked objects at
    # exit, torch, Ray) can crash while being finalised. A clean-clone `.ci/run` segfaulted
    # there once (exit 139) after all 650 tests had passed, which would fail a green run.
    if _exit_status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
