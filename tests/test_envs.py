"""raypaged/envs.py: every RAYPAGED_* variable is read there, once, at import; nothing reads the
environment per call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raypaged import envs
from raypaged.frontend.auth import auth_token_from_env
from raypaged.kernels import gemv_config, ops, pdl

PACKAGE = Path(__file__).resolve().parents[1] / "raypaged"


@pytest.mark.integration
def test_the_values_come_from_the_environment_at_import():
    code = ("import json, raypaged.envs as e; print(json.dumps([e.RAYPAGED_ATTENTION_BACKEND, "
            "e.RAYPAGED_PDL, e.RAYPAGED_GEMM_EPILOGUES, e.RAYPAGED_AUTH_TOKEN]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYPAGED_")}
    unset = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True)
    assert json.loads(unset.stdout) == [None, True, "rope,silu", None]
    env.update(RAYPAGED_ATTENTION_BACKEND="torch", RAYPAGED_PDL="0", RAYPAGED_GEMM_EPILOGUES="silu",
               RAYPAGED_AUTH_TOKEN="  token-of-sixteen-chars \n")
    set_ = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert json.loads(set_.stdout) == ["torch", False, "silu", "token-of-sixteen-chars"]


class _NoEnvironment(dict):
    def __getitem__(self, key):
        raise AssertionError(f"read the environment for {key!r} after start-up")

    def get(self, key, default=None):
        raise AssertionError(f"read the environment for {key!r} after start-up")


def test_the_hot_paths_never_read_the_environment(monkeypatch):
    monkeypatch.setattr(os, "environ", _NoEnvironment())
    x, weight = torch.zeros(gemv_config.EPILOGUE_MIN_ROWS, 64), torch.zeros(256, 64)
    pdl._enabled.cache_clear()
    assert pdl.pdl_launch(x) == {"USE_PDL": False}
    gemv_config.epilogue_config(x, weight, 64, "rope")
    ops.backend_for(x)
    auth_token_from_env()


# Readers of variables that are not raypaged's own: Ray's (launch bounds the GCS's task events,
# the security check looks at RAY_AUTH_MODE) and a docstring's example.
OTHER_READERS = {"commands/launch.py", "commands/network_security.py", "client.py"}


def test_only_envs_reads_the_environment():
    readers = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if re.search(r"os\.environ|getenv\(", path.read_text())}
    assert readers - OTHER_READERS == {"envs.py"}
    documented = set(re.findall(r"^(RAYPAGED_\w+)\s", envs.__doc__ or "", re.MULTILINE))
    assert documented == {name for name in vars(envs) if name.startswith("RAYPAGED_")}
