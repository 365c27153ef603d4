"""The FP8 KV cache's per-layer scales, from the checkpoint where it has them.

Checkpoints calibrated for an FP8 KV cache store one K and one V scale per attention layer
(per tensor: every head and rank shares it), under the names their tools write:
- compressed-tensors (llm-compressor's kv_cache_scheme): `self_attn.k_scale` / `self_attn.v_scale`
  (older ones: `self_attn.k_proj.output_scale` / `self_attn.v_proj.output_scale`);
- NVIDIA ModelOpt: `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`;
- vLLM's older FP8 format: one `self_attn.kv_scale` for both.
As vLLM does, an e4m3 pool uses them and a layer without them gets 1.0 with a warning (values
beyond ±448 then saturate); an e5m2 pool (range ±57344) always uses 1.0, and so does a float pool,
which reads none of these tensors.
"""

from __future__ import annotations

import logging

import torch

from raypaged.kernels.kv_quant import resolve_kv_cache_dtype

from .attention import PagedAttention
from .layers import TensorSource, WeightShapeError

logger = logging.getLogger(__name__)

# Under model.layers.{i}.self_attn: which scale each name holds.
_NAMES = {
    "k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
    "k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
    "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",),
    "attn.k_scale": ("k",), "attn.v_scale": ("v",), "attn.kv_scale": ("k", "v"),
}


def uses_checkpoint_scales(kv_cache_dtype: str) -> bool:
    """Whether a pool of this --kv-cache-dtype reads the checkpoint's scales (e4m3 only)."""
    return kv_cache_dtype != "auto" and resolve_kv_cache_dtype(
        kv_cache_dtype, torch.float32) == torch.float8_e4m3fn


class KvScaleLoader:
    """Loads one checkpoint scale (a single positive value) into a layer's PagedAttention."""

    def __init__(self, attn: PagedAttention, which: tuple[str, ...]) -> None:
        self.attn, self.which = attn, which
        self.loaded: set[str] = set()

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        return (1,)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        value = source.read()
        if value.numel() != 1:
            raise WeightShapeError(f"tensor {source.name!r} has shape {tuple(source.shape)}, "
                                   "expected one value (a per-tensor KV scale)")
        scale = float(value.reshape(()).float())
        if not scale > 0 or scale == float("inf"):
            raise WeightShapeError(f"KV scale {source.name!r} is {scale}: it must be positive and finite")
        for kind in self.which:
            getattr(self.attn, f"{kind}_scale").fill_(scale)
            self.loaded.add(kind)


def attention_layers(model: torch.nn.Module) -> list[PagedAttention]:
    """The model's PagedAttention modules, layer 0 first."""
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def kv_scale_loaders(layers: list[PagedAttention], names: set[str]) -> dict[str, KvScaleLoader]:
    """The loaders of the KV scales `names` (the checkpoint's tensor names) holds, by name;
    layers[i] is layer i's attention."""
    loaders = {}
    for i, attn in enumerate(layers):
        for suffix, which in _NAMES.items():
            name = f"model.layers.{i}.self_attn.{suffix}"
            if name in names:
                loaders[name] = KvScaleLoader(attn, which)
    return loaders


def warn_missing_scales(layers: list[PagedAttention], loaders: dict[str, KvScaleLoader]) -> None:
    """After loading into an e4m3 pool's model: warn about the layers left at 1.0."""
    found: dict[int, set[str]] = {}
    by_attn = {id(attn): i for i, attn in enumerate(layers)}
    for loader in loaders.values():
        found.setdefault(by_attn[id(loader.attn)], set()).update(loader.loaded)
    missing = [i for i in range(len(layers)) if found.get(i, set()) != {"k", "v"}]
    if missing:
        logger.warning(
            "FP8 KV cache: the checkpoint has no k/v scales for %d of %d layers; using 1.0 "
            "there (values beyond ±448 saturate; calibrated scales keep more precision)",
            len(missing), len(layers))
