"""Float test checkpoints with the per-layer KV scales an FP8-KV calibration writes.

The scales come from the K and V projections' output amax over one calibration batch (the float
model's forward), times a margin for rope (a rotation can raise a pair's component up to √2×)
and for inputs the batch did not see, over e4m3's 448: what llm-compressor's kv_cache_scheme
computes. Built once per process.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import _root, checkpoint_dir

# The names each tool writes, under model.layers.{i}.self_attn (model/kv_scales.py reads them).
NAMINGS = {
    "compressed-tensors": ("k_scale", "v_scale"),
    "modelopt": ("k_proj.k_scale", "v_proj.v_scale"),
    "kv_scale": ("kv_scale",),
}
MARGIN = 2.0


def kv_amax(base: str) -> list[tuple[float, float]]:
    """(K amax, V amax) of each layer of checkpoint `base` over a fixed calibration batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir(base), dtype=torch.float32).eval()
    amax: dict[tuple[int, str], float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for kind in ("k", "v"):
            def record(mod, args, out, key=(i, kind)):
                amax[key] = max(amax.get(key, 0.0), float(out.detach().abs().amax()))
            hooks.append(getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(record))
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return [(amax[i, "k"], amax[i, "v"]) for i in range(len(model.model.layers))]


@functools.cache
def kv_scaled_dir(naming: str = "compressed-tensors", base: str = "llama") -> Path:
    """A copy of float checkpoint `base` with calibrated KV scales under `naming`'s names."""
    dest = _root() / f"kv-scales-{naming}-{base}"
    if dest.exists():
        return dest
    shutil.copytree(checkpoint_dir(base), dest)
    (weights,) = dest.glob("*.safetensors")
    tensors = load_file(weights)
    for i, (k_amax, v_amax) in enumerate(kv_amax(base)):
        k_scale, v_scale = MARGIN * k_amax / 448, MARGIN * v_amax / 448
        names = NAMINGS[naming]
        values = (max(k_scale, v_scale),) if len(names) == 1 else (k_scale, v_scale)
        for name, value in zip(names, values):
            tensors[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest
