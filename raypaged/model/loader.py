"""Builds the decoder for this TP rank and fills it from a checkpoint.

load_format "auto": Hugging Face safetensors, one file or sharded through
model.safetensors.index.json. Each tensor is opened as a safetensors slice and each layer reads
only the rows/columns its rank keeps, so a rank never materialises another rank's shard.

load_format "dummy": seeded random weights of the real shapes. Each checkpoint tensor is generated
whole from a seed derived from (seed, tensor name) and then sliced like a real one, so every TP
size sees the same model and TP outputs can be compared.

Every check (names, shapes, dtypes) runs on safetensors metadata before any weight is read, so a
checkpoint the decoder cannot serve fails in a second with a message naming the problem.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .config import ModelConfig
from .kv_scales import attention_layers, kv_scale_loaders, uses_checkpoint_scales, warn_missing_scales
from .layers import WeightShapeError
from .llama import CheckpointTarget, LlamaForCausalLM
from .parallel import get_tp_rank, get_tp_size
from .quantization.fp8 import check_device
from .quantization.loading import QuantizationPlan, plan_quantization
from .quantization.schemes import resolve_quantization
from .registry import MODEL_REGISTRY

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# Checkpoint dtypes we convert from (safetensors' names).
_CHECKPOINT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LOAD_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip
# Tensors some checkpoints carry that the decoder recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The checkpoint cannot be served: wrong architecture, missing or malformed tensors."""


@dataclass
class LoadStats:
    tensors: int = 0
    bytes_read: int = 0  # bytes this rank read from the checkpoint files (or generated)
    files: list[str] = field(default_factory=list)


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """torch dtype or name ("auto" = the checkpoint's dtype) -> one of fp32/fp16/bf16."""
    if isinstance(dtype, str):
        name = config.dtype if dtype == "auto" else dtype
        if name not in _LOAD_DTYPES:
            raise CheckpointError(
                f"bad dtype {dtype!r}: expected 'auto' or one of {', '.join(_LOAD_DTYPES)}"
            )
        return _LOAD_DTYPES[name]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"bad dtype {dtype}: raypaged runs in float32, float16 or bfloat16")
    return dtype


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype and device (no fp32 copy first); the
    # process-wide default is restored however construction ends.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model: str | Path | ModelConfig,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LlamaForCausalLM:
    """The decoder for this process's TP rank (see parallel.py), weights loaded, in eval mode.

    quantization: "fp8" quantizes a float checkpoint's linear layers at load; None serves the
    checkpoint as stored (an FP8 checkpoint in FP8). model/quantization/schemes.py says which
    checkpoint formats are read; anything else quantized is an error here. kv_cache_dtype: the
    KV pool's (--kv-cache-dtype); an e4m3 pool reads the checkpoint's k/v scales
    (model/kv_scales.py)."""
    config = model if isinstance(model, ModelConfig) else ModelConfig.from_pretrained(model)
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"unknown load_format {load_format!r}; expected one of {LOAD_FORMATS}")
    if config.architecture not in MODEL_REGISTRY:
        raise CheckpointError(
            f"unknown architecture {config.architecture!r}: raypaged serves "
            f"{', '.join(MODEL_REGISTRY)}"
        )
    torch_dtype = resolve_dtype(dtype, config)
    if load_format == "auto" and config.model_dir is None:
        raise CheckpointError("load_format 'auto' needs a model directory (ModelConfig.model_dir)")
    device = torch.device(device)
    scheme = resolve_quantization(quantization, config)
    if scheme is not None:
        check_device(device)
        if load_format == "dummy":
            scheme = scheme.for_dummy_weights()
    with _default_dtype(torch_dtype), torch.device(device):
        decoder = MODEL_REGISTRY[config.architecture](config)
    decoder.eval()
    plan = None if scheme is None else plan_quantization(decoder, scheme, device)
    kv_scales = uses_checkpoint_scales(kv_cache_dtype)
    if load_format == "dummy":
        stats = load_dummy_weights(decoder, seed=seed, progress=progress)
        if kv_scales:
            warn_missing_scales(attention_layers(decoder), {})
    else:
        stats = load_weights(decoder, config.model_dir, progress=progress, plan=plan,  # type: ignore[arg-type]
                             kv_scales=kv_scales)
    if plan is not None:
        plan.finish()
    logger.info(
        "loaded %s (%s, tp rank %d/%d): %d tensors, %.1f MiB read",
        config.architecture, load_format, get_tp_rank(), get_tp_size(), stats.tensors,
        stats.bytes_read / 2**20,
    )  # fmt: skip
    return decoder


# -- safetensors -------------------------------------------------------------------------------


class SafetensorsSource:
    """A checkpoint tensor read lazily, in part, from an open safetensors file."""

    def __init__(self, name: str, handle: object, stats: LoadStats) -> None:
        self.name = name
        self._handle = handle
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.shape = tuple(self._slice.get_shape())
        self._stats = stats

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if cols is not None:
            tensor = self._slice[:, cols.start : cols.stop]
        elif rows is not None:
            tensor = self._slice[rows.start : rows.stop]
        elif not self.shape:  # a 0-d tensor (a scale) cannot be sliced
            tensor = self._handle.get_tensor(self.name)  # type: ignore[attr-defined]
        else:
            tensor = self._slice[:]
        self._stats.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = {name: model_dir / file for name, file in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index} names {path.name}, which is missing")
        return files
    single = model_dir / SAFETENSORS_SINGLE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    raise CheckpointError(
        f"no safetensors weights in {model_dir} (expected {SAFETENSORS_SINGLE} or "
        f"{SAFETENSORS_INDEX}; .bin checkpoints are not supported)"
    )


def _check_names(targets: dict[str, CheckpointTarget], files: dict[str, Path], tied: bool,
                 ignored_suffixes: tuple[str, ...] = ()) -> None:
    missing = sorted(set(targets) - set(files))
    if missing:
        raise CheckpointError(
            f"missing tensor{'s' if len(missing) > 1 else ''} in checkpoint: "
            f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}"
        )
    ignorable = {"lm_head.weight"} if tied else set()
    unexpected = sorted(
        name for name in set(files) - set(targets)
        if name not in ignorable and not name.endswith(_IGNORED_SUFFIXES + ignored_suffixes)
    )  # fmt: skip
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor{'s' if len(unexpected) > 1 else ''} in checkpoint (config.json "
            f"does not describe this checkpoint?): {', '.join(unexpected[:8])}"
            f"{' …' if len(unexpected) > 8 else ''}"
        )


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Equal up to trailing 1s: scales are written [N, 1] or [N], a single one [1] or []."""
    def strip(shape: tuple[int, ...]) -> tuple[int, ...]:
        while shape and shape[-1] == 1:
            shape = shape[:-1]
        return shape

    return a == b or strip(a) == strip(b)


def _check_metadata(targets: dict[str, CheckpointTarget], files: dict[str, Path],
                    dtypes: dict[str, tuple[str, ...]] | None = None) -> None:
    """Shapes and dtypes of every needed tensor, from the file headers only. `dtypes`: the
    safetensors dtypes allowed for a tensor where they are not the float ones (FP8 weights)."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                allowed = (dtypes or {}).get(name, tuple(_CHECKPOINT_DTYPES))
                if dtype not in allowed:
                    raise CheckpointError(
                        f"tensor {name!r} has dtype {dtype}; raypaged loads it as "
                        f"{', '.join(allowed)}"
                    )
                target = targets[name]
                expected = target.module.checkpoint_shape(target.param, target.shard)
                if not _same_shape(tuple(piece.get_shape()), tuple(expected)):
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(piece.get_shape())}, expected "
                        f"{tuple(expected)} from config.json"
                    )


def load_weights(
    model: LlamaForCausalLM, model_dir: str | Path, *, progress: bool = True,
    plan: QuantizationPlan | None = None,
    kv_scales: bool = False,
) -> LoadStats:
    """Fill `model` (built for this TP rank) from the safetensors checkpoint in `model_dir`;
    with `plan`, also the FP8 scales it adds (the caller runs plan.finish() after); with
    kv_scales, the attention layers' k/v scales the checkpoint has (else they are ignored)."""
    targets = model.checkpoint_tensors()
    if plan is not None:
        targets.update(plan.targets)
    files = checkpoint_files(model_dir)
    layers = attention_layers(model)
    scale_loaders = kv_scale_loaders(layers, set(files))
    ignored = plan.ignored_suffixes if plan is not None else ()
    if kv_scales:
        targets.update({name: CheckpointTarget(loader, "scale") for name, loader in scale_loaders.items()})
    else:
        ignored += tuple(scale_loaders)
    _check_names(targets, files, model.config.tie_word_embeddings, ignored)
    _check_metadata(targets, files, plan.dtypes if plan is not None else None)

    stats = LoadStats(files=sorted({p.name for p in files.values()}))
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    with _progress_bar(len(targets), progress) as bar:
        for path, names in sorted(by_file.items()):
            with safe_open(path, framework="pt") as f:
                for name in names:
                    target = targets[name]
                    try:
                        target.module.load_weight(
                            target.param, target.shard, SafetensorsSource(name, f, stats)
                        )
                    except WeightShapeError as e:
                        raise CheckpointError(str(e)) from e
                    stats.tensors += 1
                    bar.update(1)
    if kv_scales:
        warn_missing_scales(layers, scale_loaders)
    return stats


# -- dummy weights -----------------------------------------------------------------------------


class GeneratedSource:
    """A random checkpoint tensor, generated whole (identically on every rank) on first read."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> None:
        self.name = name
        self.shape = shape
        self._seed = seed
        self._device = device
        self._full: torch.Tensor | None = None

    def _generate(self) -> torch.Tensor:
        digest = hashlib.sha256(f"{self._seed}:{self.name}".encode()).digest()
        generator = torch.Generator(device=self._device)
        generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        full = torch.empty(self.shape, dtype=torch.float32, device=self._device)
        if self.name.endswith("norm.weight"):
            # Norm gains near 1, as in trained models, keep activations at a sane scale.
            return full.uniform_(0.9, 1.1, generator=generator)
        # Uniform with std 0.02 (transformers' initializer_range).
        bound = 0.02 * math.sqrt(3.0)
        return full.uniform_(-bound, bound, generator=generator)

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if self._full is None:
            self._full = self._generate()
        if cols is not None:
            return self._full[:, cols]
        return self._full if rows is None else self._full[rows]


def load_dummy_weights(
    model: LlamaForCausalLM, *, seed: int = 0, progress: bool = True
) -> LoadStats:
    """Fill `model` with seeded random weights, the same across TP sizes."""
    stats = LoadStats()
    device = next(model.parameters()).device
    targets = model.checkpoint_tensors()
    with _progress_bar(len(targets), progress) as bar:
        for name, target in targets.items():
            shape = target.module.checkpoint_shape(target.param, target.shard)
            target.module.load_weight(
                target.param, target.shard, GeneratedSource(name, shape, seed, device)
            )
            stats.tensors += 1
            stats.bytes_read += math.prod(shape) * 4
            bar.update(1)
    return stats


def _progress_bar(total: int, enabled: bool) -> tqdm:
    # One bar per TP group, not one per rank.
    return tqdm(
        total=total, desc="Loading weights", unit="tensor",
        disable=not enabled or get_tp_rank() != 0, leave=False,
    )  # fmt: skip
