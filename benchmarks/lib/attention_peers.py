"""The peers raypaged's attention kernels are measured against, bound to the same batches
(benchmarks/lib/attention_cases.py): FlashInfer's paged wrappers on the same pool and block
tables, and torch SDPA on contiguous copies of the same K/V.

FlashInfer is a benchmark-only dependency, imported here lazily (FlashInfer.load): nothing in
raypaged imports it, and where it cannot be imported (no GPU, CI) it is reported absent. The
version measured is 0.5.3, carried to the GPU machine as wheels (scripts/gpu.sh kernels). It
compiles its kernels on first use; FlashInfer.prebuild compiles every module the cases need in
one parallel build before anything is timed.

raypaged's pool, k_cache / v_cache [num_blocks, block_size, Hkv, D], is FlashInfer's "NHD" layout
with separate K and V tensors, and its pages are raypaged's blocks: page_table turns block
tables into FlashInfer's CSR form.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType

import torch
import torch.nn.functional as F

from benchmarks.lib.attention_cases import DecodeBatch, Kernel, PrefillBatch

# The float workspace of FlashInfer's split-KV partial results, one for all wrappers (their runs
# are serialised on one stream). FlashInfer recommends 128 MB; the batches here reach 256 requests.
WORKSPACE_BYTES = 512 * 2**20
POS_ENCODING_NONE = 0  # flashinfer.utils.PosEncodingMode.NONE: the model applies rope itself


def page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks of block_tables [S, W] as FlashInfer's page table, int32 on the same device:
    indptr [S+1] (request s owns indices[indptr[s]:indptr[s+1]]), indices (the physical blocks in
    logical order, only the ceil(seq_len / block_size) each request uses) and last_page_len [S]
    (tokens in each request's last block, 1..block_size; 0 for an empty request)."""
    lens = seq_lens.long()
    pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] < pages[:, None]
    indices = block_tables[used]  # row-major: request by request, each in logical order
    last = torch.where(lens > 0, (lens - 1) % block_size + 1, 0)
    return indptr.int(), indices.int(), last.int()


class FlashInfer:
    """The imported library and the workspace its wrappers share."""

    def __init__(self, lib: ModuleType, device: torch.device) -> None:
        self.lib, self.device = lib, device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    @classmethod
    def load(cls, device: torch.device) -> tuple[FlashInfer | None, str]:
        """(FlashInfer, its version), or (None, why it is absent)."""
        if device.type != "cuda":
            return None, "no CUDA device"
        try:
            lib = importlib.import_module("flashinfer")
        except Exception as exc:  # noqa: BLE001 - any failure to import means the peer is absent
            return None, f"not importable: {type(exc).__name__}: {str(exc)[:200]}"
        return cls(lib, device), str(lib.__version__)

    def prefill_backend(self, dtype: torch.dtype) -> str:
        """The backend BatchPrefillWithPagedKVCacheWrapper's "auto" resolves to ("fa3" on Hopper)."""
        utils = importlib.import_module("flashinfer.utils")
        return str(utils.determine_attention_backend(self.device, POS_ENCODING_NONE, False, False, dtype, dtype))

    def prebuild(self, decode_head_dims: set[int], prefill_head_dims: set[int], dtype: torch.dtype) -> float:
        """Compile, in one parallel ninja build, the modules the wrappers would otherwise compile one
        after another on first use: batch decode (CUDA cores) and the FA2 prefill module (the
        tensor-core decode) per decode head dim, the "auto" prefill backend per prefill head dim
        (and, for FA3, the page module its run() calls).
        The arguments are those the wrappers' plan() passes for bf16 K/V, int32 page indices, no
        rope, window, soft cap or fp16 QK reduction. Returns the seconds it took."""
        jit = importlib.import_module("flashinfer.jit")
        start = time.perf_counter()
        flags = (POS_ENCODING_NONE, False, False)  # rope, sliding window, logits soft cap
        specs = []
        for d in sorted(decode_head_dims):
            specs.append(jit.gen_batch_decode_module(dtype, dtype, dtype, torch.int32, d, d, *flags))
            specs.append(jit.gen_batch_prefill_module("fa2", dtype, dtype, dtype, torch.int32, d, d, *flags, False))
        backend = self.prefill_backend(dtype)
        for d in sorted(prefill_head_dims):
            if backend != "fa2" or d not in decode_head_dims:
                specs.append(jit.gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, d, d, *flags,
                                                          False))
        if prefill_head_dims and backend == "fa3":  # its run() turns pages into token offsets first
            specs.append(importlib.import_module("flashinfer.jit.page").gen_page_module())
        jit.build_jit_specs(specs)
        return time.perf_counter() - start

    def decode(self, batch: DecodeBatch, tensor_cores: bool) -> Kernel:
        """BatchDecodeWithPagedKVCacheWrapper over the batch's pool, one wrapper per rotation
        variant (a plan holds one batch), in CUDA-graph mode (fixed page-table buffers, as a server
        captures decode), planned here, outside any graph."""
        case, p = batch.case, batch.paged
        wrappers = []
        for i in range(batch.variants):
            rows = batch.rows(i)
            indptr, indices, last = page_table(p.block_tables[rows], p.seq_lens[rows], case.block_size)
            wrapper = self.lib.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=torch.empty_like(indptr),
                paged_kv_indices_buffer=torch.empty_like(indices),
                paged_kv_last_page_len_buffer=torch.empty_like(last))
            wrapper.plan(indptr, indices, last, case.num_q_heads, case.num_kv_heads, case.head_dim,
                         case.block_size, q_data_type=batch.dtype, kv_data_type=batch.dtype,
                         sm_scale=batch.scale)
            wrappers.append(wrapper)
        kv = (p.k_cache, p.v_cache)

        def run(i: int) -> torch.Tensor:
            rows = batch.rows(i)
            return wrappers[i].run(batch.q[rows], kv, out=batch.out[rows])

        return Kernel(run)

    def prefill(self, batch: PrefillBatch) -> Kernel:
        """BatchPrefillWithPagedKVCacheWrapper, causal, everything (prefix and new tokens) read
        through the page table, as a server calls it after writing the step's K/V."""
        case, p = batch.case, batch.paged
        indptr, indices, last = page_table(p.block_tables, p.seq_lens, case.block_size)
        wrapper = self.lib.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        wrapper.plan(batch.query_start_loc, indptr, indices, last, case.num_q_heads, case.num_kv_heads,
                     case.head_dim, case.block_size, causal=True, sm_scale=batch.scale,
                     q_data_type=batch.dtype, kv_data_type=batch.dtype)
        kv = (p.k_cache, p.v_cache)
        return Kernel(lambda i: wrapper.run(batch.q, kv, out=batch.out))


SDPA_DECODE_LAYOUTS = ("sdpa_folded_gqa", "sdpa_enable_gqa")
SDPA_PREFILL_LAYOUTS = ("sdpa_expanded_kv", "sdpa_enable_gqa")


def sdpa_decode(batch: DecodeBatch, layout: str) -> Kernel:
    """torch SDPA on contiguous K/V of a uniform batch, one of two layouts (the faster is the
    baseline): the query heads of a KV head as its query rows ("sdpa_folded_gqa"), or one query
    row per head with enable_gqa ("sdpa_enable_gqa", which lets the flash backend split the
    context of a small batch)."""
    case = batch.case
    keys, values = batch.dense_kv()
    b, hq, hkv, d = len(case.seq_lens), case.num_q_heads, case.num_kv_heads, case.head_dim
    if layout not in SDPA_DECODE_LAYOUTS:
        raise ValueError(f"unknown SDPA decode layout {layout!r}")
    folded = layout == "sdpa_folded_gqa"

    def run(i: int) -> torch.Tensor:
        rows = batch.rows(i)
        q4 = batch.q[rows].view(b, hkv, hq // hkv, d) if folded else batch.q[rows].view(b, hq, 1, d)
        out = F.scaled_dot_product_attention(q4, keys[rows], values[rows], scale=batch.scale, enable_gqa=not folded)
        return out.reshape(b, hq, d)

    return Kernel(run)


def sdpa_prefill(batch: PrefillBatch, layout: str) -> Kernel:
    """torch SDPA, causal, on contiguous [B, H, T, D] copies of a fresh uniform batch, one of two
    layouts: K/V repeated to every query head ("sdpa_expanded_kv"), or enable_gqa
    ("sdpa_enable_gqa"). The check sees the output back in token order; the timed call returns
    SDPA's own layout."""
    case = batch.case
    b, t, hq, d = len(case.new), case.new[0], case.num_q_heads, case.head_dim
    q4 = batch.q.view(b, t, hq, d).transpose(1, 2).contiguous()
    k4, v4 = batch.dense_kv()
    if layout == "sdpa_expanded_kv":
        group = hq // case.num_kv_heads
        k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    elif layout != "sdpa_enable_gqa":
        raise ValueError(f"unknown SDPA prefill layout {layout!r}")
    gqa = layout == "sdpa_enable_gqa"

    def to_tokens(out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2).reshape(b * t, hq, d)

    return Kernel(lambda i: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=batch.scale,
                                                           enable_gqa=gqa), to_tokens)
