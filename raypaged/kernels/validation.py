"""Input checks shared by the references and the Triton launchers.

The shape/dtype/device checks read no tensor data, so the Triton path stays free of host
synchronisation (and CUDA-graph capturable). `check_table_contents` does read data: the torch
references call it, the Triton launchers do not.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A pool may also hold FP8 K/V (kernels/kv_quant.py), read with its layer's scales.
CACHE_DTYPES = (*SUPPORTED_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"KV cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"KV cache dtypes must match and be one of {CACHE_DTYPES}, "
            f"got {k_cache.dtype}/{v_cache.dtype}"
        )
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides, with head_dim contiguous")


def _check_index(name: str, tensor: torch.Tensor, dim: int, dtypes: tuple, device) -> None:
    if tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} on {tensor.device}, expected {device}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        # The kernels step along the last dim by one element (rows take their stride).
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {tensor.stride()}")


def _check_queries(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES or (q.dtype != k_cache.dtype and not _is_fp8(k_cache)):
        raise ValueError(f"q dtype {q.dtype} does not fit a cache of {k_cache.dtype} (an FP8 "
                         f"cache takes any of {SUPPORTED_DTYPES}, any other its own dtype)")
    if q.device != k_cache.device:
        raise ValueError(f"q on {q.device} but cache on {k_cache.device}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"num query heads {q.shape[1]} is not a multiple of num kv heads {k_cache.shape[2]}"
        )
    if q.stride(-1) != 1:
        raise ValueError("q head_dim must be contiguous (stride 1)")


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in CACHE_DTYPES[len(SUPPORTED_DTYPES):]


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """An FP8 pool needs its layer's K and V scales (one fp32 element each, on its device); a
    float pool takes none. Reads no data."""
    if not _is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for FP8 KV caches; this one is {k_cache.dtype}")
        return
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an FP8 KV cache ({k_cache.dtype}) needs {name}")
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != k_cache.device:
            raise ValueError(f"{name} must be one fp32 element on {k_cache.device}, got "
                             f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")


def check_write_inputs(key, value, k_cache, v_cache, slot_mapping) -> None:
    check_cache_pair(k_cache, v_cache)
    if key.dtype not in SUPPORTED_DTYPES or value.dtype != key.dtype:
        raise ValueError(f"key/value must share one of {SUPPORTED_DTYPES}, got "
                         f"{key.dtype}/{value.dtype}")
    expected = (key.shape[0], *k_cache.shape[2:])
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be {expected}, got {tuple(key.shape)}/{tuple(value.shape)}"
        )
    if key.device != k_cache.device or value.device != k_cache.device:
        raise ValueError("key/value and the cache must be on the same device")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim must be contiguous (stride 1)")
    _check_index("slot_mapping", slot_mapping, 1, (torch.int64, torch.int32), k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    check_cache_pair(k_cache, v_cache)
    _check_queries(q, k_cache)
    _check_index("block_tables", block_tables, 2, (torch.int32,), q.device)
    _check_index("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    if block_tables.shape[0] != q.shape[0] or seq_lens.shape[0] != q.shape[0]:
        raise ValueError(
            f"{q.shape[0]} queries but block_tables has {block_tables.shape[0]} rows "
            f"and seq_lens {seq_lens.shape[0]}"
        )


def check_prefill_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    check_cache_pair(k_cache, v_cache)
    _check_queries(q, k_cache)
    _check_index("block_tables", block_tables, 2, (torch.int32,), q.device)
    _check_index("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    _check_index("query_start_loc", query_start_loc, 1, (torch.int32,), q.device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{num_seqs} seq_lens need query_start_loc of {num_seqs + 1} and block_tables of "
            f"{num_seqs} rows, got {query_start_loc.shape[0]} and {block_tables.shape[0]}"
        )


def check_table_contents(
    block_tables: torch.Tensor, seq_lens: list[int], num_blocks: int, block_size: int,
    first_keys: list[int] | None = None,
) -> None:
    """Every length fits its table row and every block it uses exists. Reads data (syncs).
    first_keys: per request, the first position read (a sliding window's start): the table's
    entries wholly before it may be anything, a freed one (-1) included, and are not checked."""
    max_blocks = block_tables.shape[1]
    lengths = torch.tensor(seq_lens, dtype=torch.int64, device=block_tables.device)
    if lengths.numel() == 0:
        return
    if int(lengths.min()) < 0:
        raise ValueError("seq_lens must be >= 0")
    if int(lengths.max()) > max_blocks * block_size:
        raise ValueError(
            f"seq_len {int(lengths.max())} exceeds block table capacity {max_blocks * block_size}"
        )
    index = torch.arange(max_blocks, device=block_tables.device)[None, :]
    needed = index * block_size < lengths[:, None]
    if first_keys is not None:
        firsts = torch.tensor(first_keys, dtype=torch.int64, device=block_tables.device)
        needed &= (index + 1) * block_size > firsts[:, None]
    used = block_tables[needed]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_tables uses block ids outside [0, {num_blocks})")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked against q's shape and dtype, or a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with contiguous head_dim, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def check_window_and_softcap(sliding_window: int | None, softcap: float | None) -> None:
    """A sliding window is a positive token count, a soft cap a positive float (None: off)."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive token count, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap!r}")
