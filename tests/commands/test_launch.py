"""`raypaged launch` as a subprocess: it starts its own Ray, logs one readiness line with the
address, serves gRPC and metrics, and on SIGTERM lets the stream in flight finish, then exits 0
leaving no process of its session behind."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from raypaged.client import Client
from tests.support.checkpoints import checkpoint_dir
from tests.support.processes import Launched, session_processes

pytestmark = pytest.mark.integration

READY = re.compile(r"raypaged ready: serving (\S+) .* on (\S+):(\d+), metrics on http://\S+:(\d+)/metrics")


def test_launch_serves_and_stops_gracefully_on_sigterm():
    launched = Launched("--model", str(checkpoint_dir("llama")), "--device", "cpu", "--port", "0",
                        "--metrics-port", "0", "--num-gpu-blocks-override", "64",
                        "--served-model-name", "tiny-llama", "--shutdown-grace", "600", ready=READY)
    try:
        launched.wait_ready()
        name, host, port, metrics_port = launched.match.groups()
        assert (name, host) == ("tiny-llama", "127.0.0.1")
        address = f"{host}:{port}"
        with Client(address) as client:
            assert client.health() == "SERVING"
            assert client.model_info().name == "tiny-llama"
            stream = client.stream([5, 6, 7, 8], max_tokens=150, temperature=0.0, ignore_eos=True)
            chunks = [next(stream)]
            launched.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 120  # a liveness bound, generous for a loaded machine
            while client.health() != "NOT_SERVING":
                assert time.monotonic() < deadline
                time.sleep(0.02)
            chunks += list(stream)  # the stream in flight runs to its end
        assert sum(len(o.token_ids) for c in chunks for o in c.outputs) == 150
        assert chunks[-1].outputs[0].finish_reason == "length"
        assert launched.process.wait(timeout=120) == 0
        output = "".join(launched.lines)
        assert "SIGTERM: shutting down" in output and "raypaged stopped" in output
        assert "Traceback" not in output
        deadline = time.monotonic() + 120  # Ray's processes (GCS, raylet, workers) exit too
        while left := session_processes(launched.process.pid):
            assert time.monotonic() < deadline, f"processes of the launch session are left: {left}"
            time.sleep(0.2)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)
    finally:
        launched.kill_session()


def test_launch_refuses_a_port_in_use_before_starting_anything():
    """Pointed at a Ray address where nothing listens, a launch that tried Ray (or loaded the
    model) first would fail on that instead: the message shows which check came first."""
    with socket.create_server(("127.0.0.1", 0)) as taken, socket.create_server(("127.0.0.1", 0)) as dead:
        port = taken.getsockname()[1]
        dead_ray = f"127.0.0.1:{dead.getsockname()[1]}"
        dead.close()
        result = subprocess.run([sys.executable, "-m", "raypaged.cli", "launch", "--port", str(port),
                                 "--address", dead_ray, "--model", "/nonexistent-model-dir"],
                                capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_launch_refuses_a_negative_engine_recovery_timeout_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "raypaged.cli", "launch", "--engine-recovery-timeout", "-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "recovery_timeout_s must be >= 0" in result.stderr
