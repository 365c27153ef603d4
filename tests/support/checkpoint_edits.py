"""A test checkpoint's tensors as saved, and the edits copy_checkpoint applies to a copy of one
(tests/support/checkpoints.py) to make a checkpoint the loader must read differently or refuse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import checkpoint_dir


def checkpoint_state(name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the named checkpoint, from its one file or all its shards."""
    path = checkpoint_dir(name)
    index = path / "model.safetensors.index.json"
    files = (
        {path / f for f in json.loads(index.read_text())["weight_map"].values()}
        if index.exists()
        else {path / "model.safetensors"}
    )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def edit_config(**changes) -> Callable[[Path], None]:
    """An edit that sets these keys of config.json."""
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))

    return edit


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    """An edit that applies change to the tensors of a one-file checkpoint, in place."""
    def edit(path: Path) -> None:
        state = load_file(path / "model.safetensors")
        change(state)
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})

    return edit
