"""The FP8 KV cache end to end (LLM → engine → worker → kernels): the Triton kernels give the
tokens of the dequantizing torch references over the same pool; every feature that moves blocks
(prefix caching, copy-on-write for n > 1, preemption, chunked prefill, async scheduling) gives the
tokens of a plain run; the pool holds twice the blocks of a 16-bit one in the same memory.

The checkpoint carries calibrated per-layer k/v scales (tests/support/kv_scale_checkpoints.py), so
the scales the kernels fold in are not 1. How close FP8 stays to a float pool is
tests/model/test_kv_scales.py's (this random model's logits are too close to ties for greedy text
to agree over many tokens under any quantization)."""

from __future__ import annotations

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.frontend.metrics import FrontendMetrics
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import random_prompts, vocab_of
from tests.support.kv_scale_checkpoints import kv_scaled_dir


def _generate(prompts, params, **engine_kwargs):
    llm = LLM(str(kv_scaled_dir()), block_size=8, kv_cache_dtype="fp8", **engine_kwargs)
    try:
        return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()


def _tokens(results) -> list[list[list[int]]]:
    return [[s.token_ids for s in r.outputs] for r in results]


def test_triton_kernels_give_the_dequantizing_references_tokens():
    # The prompt's own keys come from the step's k/v, quantized in the kernel as the pool holds
    # them; the decodes read the FP8 pool through the work list. (Chunked prompts under the
    # kernels: the slow test below.)
    prompts = random_prompts([11], vocab_of("llama"), seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _, reference = _generate(prompts, params, attention_backend="torch")
    _, triton = _generate(prompts, params, attention_backend="triton")
    assert _tokens(triton) == _tokens(reference)


def _feature_workload(**engine_kwargs):
    """Shared prefixes served from the cache (second call), n = 2 forks (copy-on-write of the
    last partial block), a 16-token budget (chunked prompts) and a pool small enough to preempt."""
    vocab = vocab_of("llama")
    prefix = random_prompts([20], vocab, seed=31)[0]
    prompts = random_prompts([9, 30, 3, 17], vocab, seed=32, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    _, expected = _generate(prompts, plain, enable_prefix_caching=False,
                            attention_backend=engine_kwargs.get("attention_backend"))
    llm = LLM(str(kv_scaled_dir()), block_size=8, kv_cache_dtype="fp8", enable_prefix_caching=True,
              max_num_batched_tokens=16, num_gpu_blocks_override=14, **engine_kwargs)
    try:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
        assert llm.engine.scheduler.stats().num_preemptions > 0
    finally:
        llm.shutdown()
    results = first + rest
    assert sum(r.num_cached_tokens for r in results) > 0
    assert _tokens(results) == [[e.outputs[0].token_ids] * 2 for e in expected]


def test_prefix_caching_copy_on_write_preemption_and_chunking_keep_the_tokens(async_scheduling):
    _feature_workload(async_scheduling=async_scheduling)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_same_with_the_triton_kernels(async_scheduling):
    _feature_workload(async_scheduling=async_scheduling, attention_backend="triton")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_pool_holds_twice_the_blocks_in_the_same_memory(kv_cache_dtype):
    sizes, pool_bytes, element_bytes = {}, {}, {}
    for kv in ("auto", kv_cache_dtype):
        llm = LLM(str(checkpoint_dir("llama")), dtype="bfloat16", block_size=8,
                  kv_cache_memory_bytes=2**20, kv_cache_dtype=kv)
        try:
            worker = llm.engine.executor.worker
            pool = worker.runner.kv_caches[0][0]
            sizes[kv] = (llm.engine.num_blocks, worker.bytes_per_block(), pool.dtype)
            metrics = FrontendMetrics("m", 64)
            metrics.record_kv_pool({"num_blocks": llm.engine.num_blocks,
                                    "kv_cache_bytes_per_block": llm.engine.kv_cache_bytes[0],
                                    "kv_cache_element_bytes": llm.engine.kv_cache_bytes[1]})
            pool_bytes[kv] = metrics.registry.get_sample_value(
                "raypaged_kv_cache_bytes", {"model_name": "m", "engine": "0"})
            element_bytes[kv] = metrics.registry.get_sample_value(
                "raypaged_kv_cache_element_bytes", {"model_name": "m", "engine": "0"})
        finally:
            llm.shutdown()
    (bf16_blocks, bf16_bytes, bf16_dtype), (fp8_blocks, fp8_bytes, fp8_dtype) = sizes.values()
    assert bf16_dtype == torch.bfloat16 and fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_bytes * 2 == bf16_bytes
    assert fp8_blocks == 2 * bf16_blocks == 2 * (2**20 // bf16_bytes)
    # The metrics show the same memory holding twice the blocks, one byte a value.
    assert pool_bytes["auto"] == pool_bytes[kv_cache_dtype] == bf16_blocks * bf16_bytes
    assert (element_bytes["auto"], element_bytes[kv_cache_dtype]) == (2, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp8_kv_on_cuda_with_and_without_cuda_graphs(enforce_eager):
    """Triton kernels on an FP8 pool on the GPU, decode through captured CUDA graphs (and mixed
    steps through piecewise graphs): the tokens of the eager torch-reference path, in fp32."""
    prompts = random_prompts([1, 7, 17, 40, 3], vocab_of("llama"), seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_num_seqs=8)
    llm, results = _generate(prompts, params, enforce_eager=enforce_eager, **common)
    _, reference = _generate(prompts, params, enforce_eager=True, attention_backend="torch", **common)
    assert _tokens(results) == _tokens(reference)


def test_the_host_tier_swaps_fp8_blocks_exactly():
    """Swap preemption moves an FP8 pool's blocks to the host tier and back (as bytes): the
    tokens are those of a pool roomy enough to preempt nothing."""
    prompts = random_prompts([17, 20, 12, 23], vocab_of("llama"), seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, roomy = _generate(prompts, params, num_gpu_blocks_override=40, async_scheduling=False)
    llm, swapped = _generate(prompts, params, num_gpu_blocks_override=10, kv_offload_size=2**-10,
                             preemption_mode="swap", enable_prefix_caching=False, async_scheduling=False)
    stats = llm.engine.scheduler.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.offloaded_bytes > 0 and stats.kv_cache.loaded_bytes > 0
    assert _tokens(swapped) == _tokens(roomy)
