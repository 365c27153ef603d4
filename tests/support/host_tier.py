"""Sizes for the host tier of the fp32 test checkpoints: --kv-offload-size is in GiB, tests count
host blocks."""

from __future__ import annotations

import json

from tests.support.checkpoints import checkpoint_dir


def host_gib(num_blocks: int, block_size: int, name: str = "llama") -> float:
    """kv_offload_size for a host pool of num_blocks blocks of block_size tokens of checkpoint
    `name` (fp32: four bytes a value; every layer's K and V)."""
    config = json.loads((checkpoint_dir(name) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_block = 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"] * head_dim * 4
    return num_blocks * per_block / 2**30
