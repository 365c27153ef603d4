"""The environment variables raypaged reads, each read once: when this module is first imported.

Nothing else in raypaged reads the environment for its own settings, and nothing reads it per
call. A Ray worker reads its own process's environment when it starts. Tests change a value by
patching the attribute here.

Settings a user may want to change belong in EngineConfig (a field and a flag); the variables
here are overrides for what a flag cannot reach (a test run, a secret).

RAYPAGED_ATTENTION_BACKEND  unset | torch | triton. The kernel backend of every op that
                            kernels/ops.set_backend has not chosen: e.g. triton on CPU under
                            TRITON_INTERPRET=1 in CI. Unset: triton for CUDA tensors, torch
                            otherwise.
RAYPAGED_PDL                1 (default) | 0. 0 turns programmatic dependent launch off in this
                            process, whatever KernelSettings.pdl (`--no-pdl`) says.
RAYPAGED_GEMM_EPILOGUES     rope,silu (default): the GEMM epilogues that may be fused, comma
                            separated; 0 or empty: none. KernelSettings.gemm_epilogues
                            (`--no-gemm-epilogues`) turns them all off.
TRITON_INTERPRET            Triton's own switch (1: kernels run in its CPU interpreter), read
                            here only so the kernels know which they are (the interpreter has
                            no libdevice); Triton reads it itself.
RAYPAGED_AUTH_TOKEN         the bearer token `raypaged launch` requires and `raypaged generate
                            --server` sends when --auth-token is not given (unset: none). Read
                            from here so that it never has to appear on a command line.
"""

from __future__ import annotations

import os

RAYPAGED_ATTENTION_BACKEND: str | None = os.environ.get("RAYPAGED_ATTENTION_BACKEND") or None
RAYPAGED_PDL: bool = os.environ.get("RAYPAGED_PDL", "1") != "0"
RAYPAGED_GEMM_EPILOGUES: str = os.environ.get("RAYPAGED_GEMM_EPILOGUES", "rope,silu")
RAYPAGED_AUTH_TOKEN: str | None = os.environ.get("RAYPAGED_AUTH_TOKEN", "").strip() or None
TRITON_INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
