"""Processes a test started, found by session (a launched server and everything it spawned)."""

from __future__ import annotations

import os


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
