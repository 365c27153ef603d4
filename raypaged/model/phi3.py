"""Phi-3 / Phi-3.5 / Phi-4 (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint tensors.

The checkpoint stores q, k and v stacked in one `qkv_proj` and gate and up in one `gate_up_proj`.
Our layers keep the same merged weights but split by rank (this rank's q heads, k heads, v heads;
its gate rows, up rows), so each fused tensor is loaded through `FusedRows`: every rank reads only
its rows of each part. Rope may be longrope (short/long factors, rope_scaling.py) and partial
(`partial_rotary_factor`, Phi-4-mini); neither changes the layers, only the step's rotary.
"""

from __future__ import annotations

from .fused_weights import FusedRows
from .llama import CheckpointTarget, LlamaForCausalLM

# fused checkpoint projection -> (block, our merged module, its shards in the fused row order)
_FUSED = {
    "qkv_proj": ("self_attn", "qkv_proj", ("q", "k", "v")),
    "gate_up_proj": ("mlp", "gate_up_proj", (0, 1)),
}
_UNFUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(self) -> dict[str, CheckpointTarget]:
        targets = {
            name: target
            for name, target in super().checkpoint_tensors().items()
            if name.split(".")[-2] not in _UNFUSED
        }
        for i, layer in enumerate(self.model.layers):
            for fused, (block, module_name, parts) in _FUSED.items():
                module = getattr(getattr(layer, block), module_name)
                for param in ("weight", "bias"):
                    if getattr(module, param, None) is not None:
                        targets[f"model.layers.{i}.{block}.{fused}.{param}"] = CheckpointTarget(
                            FusedRows(module, parts), param
                        )
        return targets
