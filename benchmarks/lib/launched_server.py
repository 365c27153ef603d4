"""The server a soak runs against: `raypaged launch` (gRPC) or `raypaged serve` (gRPC and OpenAI
HTTP) as a child process in a session of its own, so that every process it starts (Ray's
included) can be found, measured, signalled and, at the end, checked gone; and what its
Prometheus page says about the block pool."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raypaged.proto.v1 import raypaged_pb2 as pb

# launch: "... on HOST:PORT, metrics on URL"; serve adds ", OpenAI API on http://HOST:PORT/v1".
_READY = re.compile(r"raypaged ready: .* on (\S+):(\d+), metrics on (http://\S+/metrics)"
                    r"(?:, OpenAI API on (http://\S+/v1))?")


class LaunchedServer:
    """`raypaged COMMAND` (launch or serve) on free ports, metrics on. Ready once its ready line
    is logged: `address` (gRPC), `metrics_url`, and for serve `http_url` (the OpenAI base URL)."""

    def __init__(self, launch_args: list[str], env: dict[str, str] | None = None,
                 command: str = "launch") -> None:
        ports = ["--port", "0", "--metrics-port", "0"] + (["--grpc-port", "0"] if command == "serve" else [])
        self._spawn([sys.executable, "-m", "raypaged.cli", command, *ports, *launch_args], env)

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Start argv in a session of its own and read its log for the ready line (what a
        server of another command line, logging the same line, shares)."""
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **(env or {})})
        self.log: list[str] = []
        self.address: str | None = None
        self.metrics_url: str | None = None
        self.http_url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line)
            match = _READY.search(line)
            if match and not self._ready.is_set():
                self.address, self.metrics_url, self.http_url = f"{match[1]}:{match[2]}", match[3], match[4]
                self._ready.set()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("raypaged did not become ready:\n" + "".join(self.log[-30:]))

    def start(self, timeout_s: float = 300.0) -> tuple[str, str, pb.ModelInfo]:
        """Waits until ready; the gRPC address, the metrics URL and the served model's ModelInfo."""
        from raypaged.client import Client

        self.wait_ready(timeout_s)
        assert self.address is not None and self.metrics_url is not None
        with Client(self.address) as client:
            return self.address, self.metrics_url, client.model_info()

    def session_pids(self) -> list[int]:
        return session_pids(self.process.pid)

    def pids_named(self, prefix: str) -> list[int]:
        """Processes of the session whose command line starts with `prefix` (Ray retitles an
        actor's process "ray::ClassName" or "ray::ClassName.method" while it runs one)."""
        found = []
        for pid in self.session_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if argv0.startswith(prefix):
                found.append(pid)
        return sorted(found)

    def gcs_address(self) -> str | None:
        """The session's Ray GCS address, read off its raylet's command line."""
        for pid in self.pids_named(""):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
            except OSError:
                continue
            if argv and argv[0].endswith("raylet"):
                for arg in argv:
                    if arg.startswith("--gcs-address="):
                        return arg.split("=", 1)[1]
        return None

    def rss_by_process(self) -> dict[int, tuple[str, int]]:
        """pid -> (name, RSS in bytes) of each process of the session (Ray names its workers
        after their actor and task: ray::EngineActor.get_outputs, ray::RayWorkerActor…)."""
        sizes = {}
        for pid in self.session_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{pid}/status") as f:
                    rss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            except OSError:  # gone meanwhile
                continue
            name = os.path.basename(argv[0].decode(errors="replace")) or "?"
            if name.startswith("python") and len(argv) > 1:
                name = " ".join(os.path.basename(a.decode(errors="replace")) for a in argv[1:4])
            sizes[pid] = (name[:60], rss)
        return sizes

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM, then the exit status (SIGKILL to everything left if it does not exit)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def session_pids(session_id: int) -> list[int]:
    """The processes of that session (a child started with start_new_session leads its own)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session_id:
                    pids.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return pids


def scrape(metrics_url: str) -> dict[str, float]:
    """The unlabelled-by-reason gauges and counters of a /metrics page, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items())
                                        if k not in ("model_name", "engine"))
            values[key] = sample.value
    return values


def pool_whole(metrics: dict[str, float]) -> bool:
    return (metrics.get("raypaged_kv_cache_free_blocks") == metrics.get("raypaged_kv_cache_blocks")
            and metrics.get("raypaged_num_requests_running") == 0
            and metrics.get("raypaged_num_requests_waiting") == 0)


def wait_pool_whole(metrics_url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """The metrics once the pool is whole, or the last scrape when `timeout_s` passes first (the
    engine's stats reach the page about once a second)."""
    deadline = time.monotonic() + timeout_s
    while not pool_whole(metrics := scrape(metrics_url)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return metrics
