import os

# Triton kernels run in the interpreter on machines without a GPU. Must be set before triton
# is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

import pytest  # noqa: E402

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
