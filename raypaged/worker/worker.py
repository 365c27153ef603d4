"""Worker: one per device. Sets up the device and process group, loads this rank's shard of the
model, sizes the KV pool by profiling, allocates it, and runs the ModelRunner."""

from __future__ import annotations

import gc
import logging

import torch
import torch.distributed as dist

from raypaged.config import EngineConfig, KernelSettings
from raypaged.config.sections import CPU_KV_CACHE_BYTES
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.kernels import gemv_config, ops, pdl
from raypaged.kernels.kv_quant import check_kv_cache_device, resolve_kv_cache_dtype
from raypaged.model import parallel
from raypaged.model.config import ModelConfig
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.loader import load_model
from raypaged.worker.kv_layout import KVLayout
from raypaged.worker.kv_offload import HostKVCache
from raypaged.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def apply_kernel_settings(settings: KernelSettings) -> None:
    """The kernels' process-wide options, set before the model is built and its graphs captured
    (they keep the kernels they recorded). "auto" picks triton for CUDA tensors and the torch
    reference on CPU."""
    ops.set_backend(settings.attention_backend or "auto")
    pdl.set_enabled(settings.pdl)
    gemv_config.set_epilogues(settings.gemm_epilogues)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Worker:
    def __init__(self, config: EngineConfig, model_dir: str, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None, local_rank: int = 0) -> None:
        self.config = config
        self.model_dir = model_dir
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.local_rank = local_rank
        # At the engine's max_model_len: a rope may depend on it (longrope's short/long factors).
        self.model_config = ModelConfig.from_pretrained(model_dir, config.scheduler.max_model_len)
        self.device = resolve_device(config.model_settings.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", local_rank)
        self.dtype = resolve_dtype(config.model_settings.dtype, self.device)
        # The engine's KV manager is built from the same groups (EngineCore asks the same config).
        self.kv_layout = KVLayout(config.cache.kv_groups(self.model_config.all_windows()),
                                  self.model_config.num_hidden_layers)
        # What the KV pool holds: the model's dtype, or FP8 (one byte a value).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.model: LlamaForCausalLM | None = None
        self.runner: ModelRunner | None = None
        # The engine's token budget per step, told in determine_num_blocks: no piecewise graph
        # is captured for more tokens than a step can hold.
        self.max_num_batched_tokens: int | None = config.scheduler.max_num_batched_tokens

    # ---- set-up, in the order the executor calls it ------------------------------------------
    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        apply_kernel_settings(self.config.kernel)
        if self.world_size > 1:
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo",
                                    init_method=self.distributed_init_method, rank=self.rank,
                                    world_size=self.world_size)
            parallel.init_tensor_parallel()
        else:
            parallel.reset_tensor_parallel()
        torch.manual_seed(self.config.model_settings.seed)
        check_kv_cache_device(self.kv_cache_dtype, self.device)

    def load_model(self) -> None:
        self.model = load_model(self.model_config, dtype=self.dtype, device=self.device,
                                load_format=self.config.model_settings.load_format,
                                seed=self.config.model_settings.seed,
                                quantization=self.config.model_settings.quantization,
                                kv_cache_dtype=self.config.cache.kv_cache_dtype)

    def bytes_per_block(self) -> int:
        mc = self.model_config
        kv_heads = mc.num_kv_heads_per_rank(self.world_size)
        element = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        layers = self.kv_layout.layers_per_block  # a block holds one KV-cache group's layers
        return 2 * layers * self.config.scheduler.block_size * kv_heads * mc.head_dim * element

    def kv_cache_sizes(self) -> tuple[int, int]:
        """(bytes of one KV block, bytes of one cached value) on this rank."""
        return self.bytes_per_block(), torch.tensor([], dtype=self.kv_cache_dtype).element_size()

    def num_host_blocks(self) -> int:
        """Blocks of this rank's host tier (cache.kv_offload_size GiB); the engine takes the
        minimum over ranks."""
        return int(self.config.cache.kv_offload_size * 2**30) // self.bytes_per_block()

    def determine_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """How many KV blocks this rank can hold; the executor takes the minimum over ranks."""
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.config.cache.num_gpu_blocks_override is not None:
            return self.config.cache.num_gpu_blocks_override
        per_block = self.bytes_per_block()
        if self.device.type != "cuda":
            budget = self.config.cache.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES
            return max(1, budget // per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        available = self.config.cache.gpu_memory_utilization * total - peak
        torch.cuda.empty_cache()
        num_blocks = int(available // per_block)
        logger.info("KV profiling: peak %.2f GiB of %.2f GiB, %d blocks of %d bytes", peak / 2**30,
                    total / 2**30, num_blocks, per_block)
        if num_blocks < 1:
            raise RuntimeError("no memory is left for the KV cache: lower max_num_batched_tokens, "
                               "or raise gpu_memory_utilization")
        return num_blocks

    def _profile_run(self, num_tokens: int) -> None:
        """A forward at the largest batch the scheduler may send, on a one-block pool that is
        never written (slot -1), so the peak covers activations, logits and sampling."""
        from raypaged.model.attention import AttentionMetadata

        mc = self.model_config
        kv_heads = mc.num_kv_heads_per_rank(self.world_size)
        caches = [(torch.zeros(1, self.config.scheduler.block_size, kv_heads, mc.head_dim,
                               dtype=self.kv_cache_dtype, device=self.device),) * 2
                  for _ in range(mc.num_hidden_layers)]
        num_seqs = min(self.config.scheduler.max_num_seqs, num_tokens)
        per_seq = num_tokens // num_seqs
        width = -(-per_seq // self.config.scheduler.block_size)
        dev = self.device
        # Every logical block maps to the pool's one block: the kernels read real memory, and
        # nothing is written (slot -1).
        metadata = AttentionMetadata(
            slot_mapping=torch.full((per_seq * num_seqs,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(num_seqs, width, dtype=torch.int32, device=dev),
            seq_lens=torch.full((num_seqs,), per_seq, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * per_seq,
            num_decodes=num_seqs if per_seq == 1 else 0,
            num_decode_tokens=num_seqs if per_seq == 1 else 0,
            max_query_len=per_seq,
        )
        with torch.inference_mode():
            ids = torch.zeros(per_seq * num_seqs, dtype=torch.int64, device=dev)
            positions = torch.arange(per_seq, device=dev).repeat(num_seqs)
            model = self._loaded_model()
            hidden = model(ids, positions, caches, metadata)
            rows = torch.arange(num_seqs, device=dev) * per_seq + per_seq - 1
            logits = model.compute_logits(hidden[rows])
            torch.softmax(logits.float(), dim=-1)  # the sampler's largest temporary

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        mc = self.model_config
        kv_heads = mc.num_kv_heads_per_rank(self.world_size)
        shape = (num_blocks, self.config.scheduler.block_size, kv_heads, mc.head_dim)
        pool = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                for _ in range(self.kv_layout.layers_per_block)]
        kv_caches = self.kv_layout.per_layer(pool)
        self.runner = ModelRunner(self._loaded_model(), kv_caches, self.config.scheduler.block_size, max_model_len,
                                  vocab_size=mc.vocab_size, device=self.device, is_driver=self.rank == 0,
                                  seed=self.config.model_settings.seed,
                                  async_output=self.config.scheduler.async_scheduling,
                                  layer_groups=self.kv_layout.layer_groups)
        if self.config.cache.kv_offload_size:
            self.runner.host_kv = HostKVCache(self.num_host_blocks(), kv_caches)
        if self.device.type == "cuda" and not self.config.compilation.enforce_eager:
            self.runner.capture_cuda_graphs(self.config.scheduler.max_num_seqs,
                                            self._piecewise_max_tokens())
        if self.device.type == "cuda" and ops.backend_for(kv_caches[0][0]) == "triton":
            from raypaged.kernels.warmup import warm_up_attention

            kinds = [(mc.window_of(i), mc.attn_logit_softcapping) for i in range(mc.num_hidden_layers)]
            seconds = warm_up_attention(*kv_caches[0], mc.num_attention_heads // self.world_size, kinds,
                                        query_dtype=self.dtype)
            logger.info("attention kernels compiled in %.1f s", seconds)

    def _loaded_model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("load_model() must run first")
        return self.model

    def _piecewise_max_tokens(self) -> int | None:
        """The largest piecewise-graph bucket, or None for no piecewise graphs."""
        if not self.config.compilation.piecewise_cuda_graph:
            return None
        cap = self.config.compilation.piecewise_cuda_graph_max_tokens
        return min(cap, self.max_num_batched_tokens or cap)

    # ---- per step ----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None  # initialize_cache() ran
        output = self.runner.execute_model(scheduler_output)
        host_kv = self.runner.host_kv
        if host_kv is not None:
            # Every rank's own totals ride on its answer (the executor keeps the slowest's): a
            # rank that samples nothing answers with them alone. No call of their own per step.
            if output is None:
                output = ModelRunnerOutput()
            output.kv_copy_times = host_kv.copy_times()
        return output

    def shutdown(self) -> None:
        apply_kernel_settings(KernelSettings())  # this process may build another engine
        parallel.reset_tensor_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.runner is not None:
            self.runner.release()
        self.runner = None
        self.model = None
        if self.device.type == "cuda":
            # The engine freezes the collector after start-up; anything of this worker caught in
            # a reference cycle is only found by an explicit collection.
            gc.collect()
            torch.cuda.empty_cache()
