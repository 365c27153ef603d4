"""The engine's KV-cache manager, chosen from its settings once the workers have sized the pool.

Four managers, by two questions: is the pool paged or the contiguous reservation baseline
(cache.kv_cache_mode), and, when paged, does a host tier stand behind it (cache.kv_offload_size)?
The paged pool is laid out by KV-cache group (config.cache.kv_groups, which the workers' pools
read too, so both agree): one full group is the plain KVCacheManager (or TieredKVCacheManager),
anything else the HybridKVCacheManager (or TieredHybridKVCacheManager).

A manager that can never work (a host tier holding no block, a pool smaller than one
contiguous reservation) is an error here; the caller shuts its workers down.
"""

from __future__ import annotations

import logging

from raypaged.config import ConfigError, EngineConfig
from raypaged.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from raypaged.core.kv_cache_groups import KVCacheGroupSpec, make_kv_cache_manager
from raypaged.core.kv_cache_interface import KVCacheManagerInterface
from raypaged.core.tiered_hybrid_kv_cache_manager import TieredHybridKVCacheManager
from raypaged.core.tiered_kv_cache_manager import TieredKVCacheManager
from raypaged.executor.base import Executor
from raypaged.model.config import ModelConfig

__all__ = ["kv_cache_manager_for"]

logger = logging.getLogger(__name__)


def kv_cache_manager_for(config: EngineConfig, model_config: ModelConfig, executor: Executor,
                         num_blocks: int, max_num_batched_tokens: int) -> KVCacheManagerInterface | None:
    """The manager of num_blocks blocks for these settings; None: the scheduler's own (the plain
    paged manager). Raises ConfigError (a host tier too small for one block) or ValueError (a
    contiguous pool too small for one request); nothing is shut down here."""
    if config.cache.kv_cache_mode == "contiguous":
        return ContiguousKVCacheManager(num_blocks, config.scheduler.block_size,
                                        model_config.max_model_len)
    groups = config.cache.kv_groups(model_config.all_windows())
    if config.cache.kv_offload_size:
        return _tiered_manager(config, executor, num_blocks, groups, max_num_batched_tokens)
    if len(groups) == 1 and not groups[0].is_sliding:
        return None
    settings = config.scheduler
    return make_kv_cache_manager(num_blocks, settings.block_size, groups,
                                 settings.enable_prefix_caching,
                                 max_tokens_per_step=max_num_batched_tokens,
                                 hash_algo=settings.prefix_caching_hash_algo)


def _tiered_manager(config: EngineConfig, executor: Executor, num_blocks: int,
                    groups: tuple[KVCacheGroupSpec, ...], max_num_batched_tokens: int
                    ) -> TieredKVCacheManager | TieredHybridKVCacheManager:
    """The host tier behind the GPU pool (cache.kv_offload_size), of as many blocks as every
    rank's host pool holds; over the KV-cache groups when there are several."""
    cache, settings = config.cache, config.scheduler
    num_host_blocks = min(executor.collective_rpc("num_host_blocks"))
    if num_host_blocks < 1:
        raise ConfigError(f"kv_offload_size ({cache.kv_offload_size} GiB) holds no KV block")
    if not settings.enable_prefix_caching and cache.preemption_mode != "swap":
        logger.warning("kv_offload_size without prefix caching or swap preemption: the host "
                       "tier holds nothing a request could use")
    swap = cache.preemption_mode == "swap"
    block_bytes = sum(executor.collective_rpc("bytes_per_block"))
    if len(groups) == 1 and not groups[0].is_sliding:
        return TieredKVCacheManager(
            num_blocks, settings.block_size, settings.enable_prefix_caching,
            num_host_blocks=num_host_blocks, swap_preemption=swap, block_bytes=block_bytes,
            hash_algo=settings.prefix_caching_hash_algo)
    return TieredHybridKVCacheManager(
        num_blocks, settings.block_size, groups, settings.enable_prefix_caching,
        max_tokens_per_step=max_num_batched_tokens, num_host_blocks=num_host_blocks,
        swap_preemption=swap, block_bytes=block_bytes, hash_algo=settings.prefix_caching_hash_algo)
