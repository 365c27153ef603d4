"""`serve run deploy/serve_demo.yaml`, exactly as written, as a subprocess: it starts its own Ray,
serves the demo model over OpenAI HTTP on :8000 and raypaged.v1 gRPC on :9000, and on SIGINT
stops, leaving no process of its session behind. Slow (a whole Ray cluster start-up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import openai
import pytest
import requests

from raypaged.proto.v1 import raypaged_pb2 as pb
from raypaged.proto.v1 import raypaged_pb2_grpc as pb_grpc
from tests.support.checkpoints import demo_model_missing
from tests.support.processes import session_processes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(demo_model_missing(), reason="the built-in demo model (raypaged/demo_model) is not built")
def test_serve_run_demo_config_as_written():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    serve_cli = Path(sys.executable).with_name("serve")
    process = subprocess.Popen([str(serve_cli), "run", "deploy/serve_demo.yaml"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, "serve run exited:\n" + "".join(lines[-40:])
            assert time.monotonic() < deadline, "never ready:\n" + "".join(lines[-40:])
            try:
                if requests.get("http://127.0.0.1:8000/v1/models", timeout=2).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):  # the proxy is up before the app
                pass
            time.sleep(1)
        api = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0)
        chunks = list(api.completions.create(model="demo", prompt="def fib(n):", max_tokens=16,
                                             temperature=0.0, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens >= 1 and text
        with grpc.insecure_channel("127.0.0.1:9000") as channel:
            stub = pb_grpc.RaypagedServiceStub(channel)
            request = pb.GenerateRequest(prompt="def fib(n):", sampling_params=pb.SamplingParams(
                max_tokens=16, temperature=0.0))
            grpc_text = "".join(d.text for m in stub.Generate(request, timeout=60) for d in m.outputs)
        assert grpc_text == text  # the same greedy continuation over both transports
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) is not None
        deadline = time.monotonic() + 30
        while session_processes(process.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(process.pid) == []
    finally:
        for pid in session_processes(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
