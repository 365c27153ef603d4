"""Engine settings, named and defaulted as vLLM names them, and their command-line flags.

Shared by every layer above core (engine, executor, worker), so it lives beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from raypaged.core.errors import InvalidRequestError

KV_CACHE_MODES = ("paged", "contiguous")


@dataclass
class EngineConfig:
    model: str | None = None  # a Hugging Face model directory; None: the built-in demo model
    tokenizer: str | None = None  # defaults to the model directory
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: bf16 on CUDA, fp32 on CPU)
    load_format: str = "auto"  # auto | dummy (random weights of the checkpoint's shapes)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len) with chunking off
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # CPU: how much memory the KV pool may take
    max_waiting_requests: int | None = None
    enforce_eager: bool = False  # no CUDA graphs (they are used for decode steps on CUDA)
    # Steps mixing prefill chunks (up to piecewise_cuda_graph_max_tokens tokens) replay CUDA
    # graphs of everything but attention. Off to measure their effect.
    piecewise_cuda_graph: bool = True
    # Larger steps run eagerly: a big prefill is GPU-bound anyway, and each bucket costs
    # num_layers + 1 graphs of capture time.
    piecewise_cuda_graph_max_tokens: int = 2048
    attention_backend: str | None = None  # torch | triton; None: triton on CUDA, torch on CPU
    scheduling_policy: str = "fcfs"
    # Schedule step N+1 while the GPU runs step N (the workers answer each step one call late):
    # the host's part of a step (scheduling, inputs, Ray's dispatch and return) hides behind the
    # GPU's. A request that stops computes one token more, which is dropped. On by default: the
    # host's part, Ray's included, stops adding to the step (benchmarks/README.md); outputs are
    # the same tokens either way.
    async_scheduling: bool = True
    # paged: blocks on demand (PagedAttention). contiguous: every request reserves max_model_len
    # slots up front, the allocator PagedAttention replaces; kept as the benchmark baseline.
    kv_cache_mode: str = "paged"
    # Ray (tensor_parallel_size > 1, or the engine actor)
    distributed_executor_backend: str | None = None  # "uni" | "ray"; None: ray when tp > 1
    ray_address: str | None = None  # None: start a local Ray (or use the one this process joined)
    ray_cpus_per_worker: float | None = None  # None: 1 per GPU worker, 0.25 per CPU worker
    use_compiled_graph: bool = True  # the per-step broadcast via a Ray Compiled Graph
    step_timeout_s: float = 60.0  # a step slower than this means a hung worker group
    ray_start_timeout_s: float = 300.0
    max_worker_restarts: int = 3  # failed worker-group restarts in a row before giving up

    def validate(self) -> None:
        checks = [
            (self.dtype in ("auto", "float32", "float16", "bfloat16"), f"unknown dtype {self.dtype!r}"),
            (self.load_format in ("auto", "dummy"), f"unknown load_format {self.load_format!r}"),
            (self.device in ("auto", "cpu", "cuda"), f"unknown device {self.device!r}"),
            (self.block_size in (8, 16, 32), f"block_size must be 8, 16 or 32, got {self.block_size}"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.piecewise_cuda_graph_max_tokens >= 1, "piecewise_cuda_graph_max_tokens must be >= 1"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.attention_backend in (None, "torch", "triton"),
             f"unknown attention_backend {self.attention_backend!r}"),
            (self.distributed_executor_backend in (None, "uni", "ray"),
             f"unknown distributed_executor_backend {self.distributed_executor_backend!r}"),
            (self.distributed_executor_backend != "uni" or self.tensor_parallel_size == 1,
             "tensor_parallel_size > 1 needs the ray executor"),
            (self.scheduling_policy in ("fcfs", "priority"),
             f"unknown scheduling_policy {self.scheduling_policy!r}"),
            (self.kv_cache_mode in KV_CACHE_MODES,
             f"kv_cache_mode must be one of {KV_CACHE_MODES}, got {self.kv_cache_mode!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        group.add_argument("--model", default=None, help="model directory (default: built-in demo model)")
        group.add_argument("--tokenizer", default=None)
        group.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
        group.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
        group.add_argument("--seed", type=int, default=None,
                           help="seeds random weights and unseeded sampling (default 0); "
                                "`generate` also uses it as the request's sampling seed")
        group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        group.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
        group.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
        group.add_argument("--max-model-len", type=int, default=None)
        group.add_argument("--max-num-seqs", type=int, default=256)
        group.add_argument("--max-num-batched-tokens", type=int, default=None)
        group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        group.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        group.add_argument("--num-gpu-blocks-override", type=int, default=None)
        group.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_parse_bytes, default=None,
                           help="KV pool size on CPU, e.g. 512MiB")
        group.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
        group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        group.add_argument("--piecewise-cuda-graph", action=argparse.BooleanOptionalAction,
                           default=True,
                           help="CUDA graphs of everything but attention for steps that mix "
                                "prefills (default on)")
        group.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=2048,
                           help="steps with more tokens than this run eagerly")
        group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
        group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                           help="schedule each step while the previous one runs on the GPU "
                                "(default on; --no-async-scheduling: one step at a time)")
        group.add_argument("--kv-cache-mode", default="paged", choices=list(KV_CACHE_MODES),
                           help="paged (default), or contiguous: each request reserves "
                                "max_model_len slots up front (the baseline for benchmarks)")
        group.add_argument("--distributed-executor-backend", default=None, choices=["uni", "ray"],
                           help="workers in this process (uni) or in Ray actors (default: ray when tp > 1)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        if values.get("seed") is None:
            values.pop("seed", None)
        return cls(**values)


def _parse_bytes(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)
