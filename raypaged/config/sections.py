"""The sections of the engine's settings, named and defaulted as vLLM names them.

Each field's default is stated here once (the scheduler's own limits once, in core's
SchedulerConfig, which these defaults read); its flag and help text are derived from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raypaged.config.base import ConfigError, check, check_choices, parse_bytes, setting
from raypaged.core.block_hashing import HASH_ALGOS
from raypaged.core.kv_cache_groups import KVCacheGroupSpec, group_layers
from raypaged.core.scheduler_config import POLICIES, SchedulerConfig

KV_CACHE_MODES = ("paged", "contiguous")
# auto: the model's dtype; fp8 is fp8_e4m3 (kernels/kv_quant.py maps the names to torch dtypes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_value_bytes(kv_cache_dtype: str, model_value_bytes: int = 2) -> int:
    """Bytes of one cached K or V value: the model's for "auto", 1 for the FP8 pools."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
    return model_value_bytes if kv_cache_dtype == "auto" else 1


PREEMPTION_MODES = ("recompute", "swap")
# The paged-attention kernels are compiled for these block sizes (the scheduler takes any).
BLOCK_SIZES = (8, 16, 32)
# What a Ray worker reserves unless ray_cpus_per_worker says: a GPU worker's host thread needs
# a core; CPU workers in tests share them.
GPU_WORKER_CPUS = 1.0
CPU_WORKER_CPUS = 0.25
# The KV pool on CPU, where there is no memory to profile, unless kv_cache_memory_bytes says.
CPU_KV_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ModelSettings:
    """Which model, how its weights are loaded, and on which device it runs."""

    model: str | None = setting(None, "model directory (default: the built-in demo model)")
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model directory)")
    dtype: str = setting("auto", "weights and activations; auto: bfloat16 on CUDA, float32 on CPU",
                         choices=("auto", "float32", "float16", "bfloat16"))
    load_format: str = setting("auto", "dummy: random weights of the checkpoint's shapes",
                               choices=("auto", "dummy"))
    quantization: str | None = setting(
        None, "fp8: quantize a float checkpoint's linear layers to FP8 (e4m3) at load; an FP8 "
              "checkpoint (compressed-tensors, ModelOpt) is served in FP8 without it",
        choices=(None, "fp8"))
    seed: int = setting(0, "seeds random weights and unseeded sampling; `generate` also uses it "
                           "as the request's sampling seed")
    device: str = setting("auto", "auto: cuda where there is one", choices=("auto", "cpu", "cuda"))
    structured_output_compile_timeout_s: float = setting(
        30.0, "seconds a structured output's grammar may take to compile before its request is "
              "ended with an error")

    def validate(self) -> None:
        check_choices(self)
        if not self.structured_output_compile_timeout_s > 0:
            raise ConfigError("structured_output_compile_timeout_s must be > 0")


@dataclass(frozen=True)
class SchedulerSettings:
    """The scheduler's limits and policies: what core's SchedulerConfig is built from once the
    model's length and the KV pool's size are known (build())."""

    block_size: int = setting(SchedulerConfig.block_size, "tokens per KV block",
                              choices=BLOCK_SIZES)
    max_model_len: int | None = setting(
        None, "prompt + output tokens of one request (default: the model's max_position_embeddings)")
    max_num_seqs: int = setting(SchedulerConfig.max_num_seqs, "requests in the running batch at once")
    max_num_batched_tokens: int | None = setting(
        None, f"tokens computed per step over all requests (default: "
              f"{SchedulerConfig.max_num_batched_tokens}; without chunked prefill at least "
              f"max_model_len)")
    enable_prefix_caching: bool = setting(SchedulerConfig.enable_prefix_caching,
                                          "share the KV blocks of common prompt prefixes")
    prefix_caching_hash_algo: str = setting(
        SchedulerConfig.prefix_caching_hash_algo,
        "the prefix cache's block hash: sha256 (the same in every process, which data "
        "parallelism's router needs) or builtin (Python's hash, per process)", choices=HASH_ALGOS)
    enable_chunked_prefill: bool = setting(SchedulerConfig.enable_chunked_prefill,
                                           "split long prompts over steps, beside the decodes")
    scheduling_policy: str = setting(SchedulerConfig.policy,
                                     "fcfs: arrival order; priority: lower Request.priority first",
                                     choices=POLICIES)
    max_waiting_requests: int | None = setting(
        SchedulerConfig.max_waiting_requests,
        "requests queued before new ones are refused as RESOURCE_EXHAUSTED / 429; a server's front "
        "door sheds at the same bound before the engine (default: unbounded; servers: "
        "1024)")
    # On by default, unlike a bare Scheduler: the host's part of a step (scheduling, inputs, Ray's
    # dispatch and return) then hides behind the GPU's. A request that stops computes one token
    # more, which is dropped; the outputs are the same tokens either way.
    async_scheduling: bool = setting(
        True, "schedule each step while the previous one runs on the GPU "
              "(--no-async-scheduling: one step at a time)")

    def validate(self) -> None:
        check_choices(self)
        check([(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")])

    def token_budget(self, max_model_len: int) -> int:
        """max_num_batched_tokens, or its default for this model length: without chunking a
        prompt is computed in one step, so the step must hold the longest one."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = SchedulerConfig.max_num_batched_tokens
        return default if self.enable_chunked_prefill else max(default, max_model_len)

    def build(self, num_blocks: int, max_model_len: int) -> SchedulerConfig:
        """Core's SchedulerConfig for a pool of `num_blocks` and the model's `max_model_len`
        (its checks raise ValueError)."""
        return SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.token_budget(max_model_len), max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling_policy,
            max_waiting_requests=self.max_waiting_requests, async_scheduling=self.async_scheduling)


@dataclass(frozen=True)
class CacheSettings:
    """How large the KV pool is and how it is handed out."""

    gpu_memory_utilization: float = setting(
        0.9, "share of GPU memory for weights, activations and the KV pool together")
    num_gpu_blocks_override: int | None = setting(None, "KV blocks, instead of sizing the pool "
                                                        "by profiling")
    kv_cache_memory_bytes: int | None = setting(
        None, f"KV pool size on CPU, e.g. 512MiB (default: {CPU_KV_CACHE_BYTES // 2**20}MiB)",
        flags=("--kv-cache-memory",), parse=parse_bytes)
    # contiguous: the allocator PagedAttention replaces, kept as the benchmark baseline.
    kv_cache_mode: str = setting(
        "paged", "paged: blocks on demand; contiguous: each request reserves max_model_len slots "
                 "up front", choices=KV_CACHE_MODES)
    kv_cache_groups: bool = setting(
        True, "paged, for models with sliding-window layers: one block table per group of layers "
              "of one attention kind, sliding ones holding only their window's blocks "
              "(--no-kv-cache-groups: every layer one full-length table)")
    kv_cache_dtype: str = setting(
        "auto", "what the KV pool holds: auto, the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2, "
                "one byte a value (twice the blocks in the same memory), quantized with the "
                "checkpoint's per-layer k/v scales (e4m3; else 1.0)", choices=KV_CACHE_DTYPES)
    kv_offload_size: float = setting(
        0.0, "GiB of host memory per rank for a second tier of KV blocks behind the GPU pool: "
             "evicted prefix-cache blocks are copied there and come back on a prefix hit (default: "
             "0, no host tier)", flags=("--kv-offload-size", "--cpu-offload-gb"))
    preemption_mode: str = setting(
        "recompute", "recompute: a preempted request computes its KV again; swap: its blocks go "
                     "to the host tier (needs --kv-offload-size) and come back on resumption",
        choices=PREEMPTION_MODES)

    def validate(self) -> None:
        check_choices(self)
        check([
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
            (self.kv_offload_size >= 0, "kv_offload_size must be >= 0"),
            (self.preemption_mode != "swap" or self.kv_offload_size > 0,
             "preemption_mode swap needs a host tier: set kv_offload_size"),
            (not self.kv_offload_size or self.kv_cache_mode == "paged",
             "kv_offload_size needs kv_cache_mode paged"),
        ])

    def kv_groups(self, layer_windows: tuple[int | None, ...]) -> tuple[KVCacheGroupSpec, ...]:
        """The KV-cache groups of a model whose layer i has sliding window layer_windows[i]
        (None: full): what the engine's manager and every worker's pool are built from, so both
        ask here. One full group of every layer unless the paged pool groups a model with a
        sliding layer."""
        if self.kv_cache_mode == "paged" and self.kv_cache_groups \
                and any(w is not None for w in layer_windows):
            return group_layers(layer_windows)
        return (KVCacheGroupSpec(None, tuple(range(len(layer_windows)))),)


@dataclass(frozen=True)
class ParallelSettings:
    """Tensor parallelism, and the Ray worker group that runs it."""

    tensor_parallel_size: int = setting(1, "GPUs (or CPU workers) the model is split over",
                                        flags=("--tensor-parallel-size", "--tp"))
    distributed_executor_backend: str | None = setting(
        None, "workers in this process (uni) or in Ray actors (default: ray when tp > 1)",
        choices=(None, "uni", "ray"))
    ray_address: str | None = setting(
        None, "Ray cluster to join: auto, or HOST:PORT (default: start a local Ray, or use the one "
              "this process joined)", flags=("--ray-address", "--address"))
    ray_cpus_per_worker: float | None = setting(
        None, f"CPUs each Ray worker reserves (default: {GPU_WORKER_CPUS:g} per GPU worker, "
              f"{CPU_WORKER_CPUS:g} per CPU worker)")
    use_compiled_graph: bool = setting(True, "broadcast each step through a Ray Compiled Graph "
                                             "(a tenth of a plain actor call's cost)")
    step_timeout_s: float = setting(60.0, "a step slower than this means a hung worker group")
    worker_health_check_interval_s: float = setting(
        2.0, "seconds between an idle engine's checks of its Ray workers (a worker that died or hung "
             "between requests is replaced then, not when the next request waits on it); 0: never")
    ray_start_timeout_s: float = setting(300.0, "seconds the worker group may take to start")
    placement_timeout_s: float = setting(
        120.0, "seconds a worker group waits for the cluster to place its workers: at start, and "
               "after its node was lost for capacity to take it (each restart waits again)")
    max_worker_restarts: int = setting(3, "failed worker-group restarts in a row before the "
                                          "engine gives up")

    def validate(self) -> None:
        check_choices(self)
        check([
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.distributed_executor_backend != "uni" or self.tensor_parallel_size == 1,
             "tensor_parallel_size > 1 needs the ray executor"),
            (self.placement_timeout_s > 0, "placement_timeout_s must be > 0"),
            (self.worker_health_check_interval_s >= 0, "worker_health_check_interval_s must be >= 0"),
        ])

    @property
    def uses_ray_workers(self) -> bool:
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend == "ray"

    def cpus_per_worker(self, use_gpu: bool) -> float:
        return self.ray_cpus_per_worker or (GPU_WORKER_CPUS if use_gpu else CPU_WORKER_CPUS)


@dataclass(frozen=True)
class CompilationSettings:
    """CUDA graphs: of whole decode steps, and piecewise (all but attention) for mixed steps."""

    enforce_eager: bool = setting(False, "no CUDA graphs")
    piecewise_cuda_graph: bool = setting(
        True, "CUDA graphs of everything but attention for steps that mix in prefill chunks")
    # Larger steps run eagerly: a big prefill is GPU-bound anyway, and each bucket costs
    # num_layers + 1 graphs of capture time.
    piecewise_cuda_graph_max_tokens: int = setting(2048, "steps with more tokens than this run "
                                                         "eagerly")

    def validate(self) -> None:
        check([(self.piecewise_cuda_graph_max_tokens >= 1,
                "piecewise_cuda_graph_max_tokens must be >= 1")])


@dataclass(frozen=True)
class KernelSettings:
    """Which kernels run, and the launch features a user may want off (to compare, or to work
    around a driver)."""

    attention_backend: str | None = setting(
        None, "torch (the references) or triton (default: triton on CUDA, torch on CPU)",
        choices=(None, "torch", "triton"))
    pdl: bool = setting(True, "programmatic dependent launch of the decode kernels, where the "
                              "GPU (Hopper and later) has it")
    gemm_epilogues: bool = setting(True, "fuse RoPE and SwiGLU into the small-batch GEMMs where "
                                         "the device's tuned table covers them (FP8 weights: "
                                         "the steps the FP8 tensor-core skinny GEMM takes)")

    def validate(self) -> None:
        check_choices(self)


@dataclass(frozen=True)
class ServingSettings:
    """How a server's front door sheds load and times requests out, before they reach the engine
    (frontend/load_shedding.py). Beside these, max_waiting_requests (scheduler) bounds the
    requests that wait for their first token. The defaults shed nothing in normal use."""

    max_waiting_tokens: int | None = setting(
        None, "prompt tokens waiting for their first output token before new requests are shed "
              "as 429 / RESOURCE_EXHAUSTED; a request alone in the queue always passes (default: "
              "unbounded)")
    shed_kv_usage: float | None = setting(
        None, "shed new requests while the KV pool is at least this full (a fraction) and requests "
              "are already waiting (default: never)")
    retry_after_s: float | None = setting(
        None, "the Retry-After a shed request is told (default: estimated, the waiting requests "
              "over the recent completion rate, 1 to 60 s)")
    request_timeout_s: float | None = setting(
        None, "seconds a request may run before it is aborted and answered 504 / DEADLINE_EXCEEDED; "
              "an HTTP request may set its own with an X-Request-Timeout header, a gRPC one with "
              "its deadline (default: none)")

    def validate(self) -> None:
        check([
            (self.max_waiting_tokens is None or self.max_waiting_tokens >= 1,
             "max_waiting_tokens must be >= 1"),
            (self.shed_kv_usage is None or 0.0 < self.shed_kv_usage <= 1.0,
             "shed_kv_usage must be in (0, 1]"),
            (self.retry_after_s is None or self.retry_after_s >= 0, "retry_after_s must be >= 0"),
            (self.request_timeout_s is None or self.request_timeout_s > 0,
             "request_timeout_s must be > 0"),
        ])


SECTIONS: tuple[type, ...] = (ModelSettings, SchedulerSettings, CacheSettings, ParallelSettings,
                              CompilationSettings, KernelSettings, ServingSettings)


def _owners() -> dict[str, type]:
    owners: dict[str, type] = {}
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert f.name not in owners, f"setting {f.name} is declared twice"
            owners[f.name] = section
    return owners


# Every setting's name is unique across sections: the flat names of EngineConfig(**settings),
# a Serve config's `args:` and the flags.
SETTING_OWNERS: dict[str, type] = _owners()
