"""Processes a test started, found by session (a launched server and everything it spawned)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time


def session_processes(sid: int) -> list[int]:
    """Processes of a session (Ray's workers have process groups of their own, not sessions)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


class Launched:
    """`raypaged COMMAND ARGS...` in a session of its own; ready once a line matches `ready`."""

    def __init__(self, *args: str, ready: re.Pattern[str], command: str = "launch") -> None:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raypaged.cli", command, *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.ready_line = ready
        self.match: re.Match | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if self.match is None and (match := self.ready_line.search(line)):
                self.match = match
                self.ready.set()

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the server never became ready:\n" + "".join(self.lines[-40:]))

    def kill_session(self) -> None:
        for pid in session_processes(self.process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
