"""Tiny random Hugging Face checkpoints for every architecture raypaged serves.

Each is built with transformers itself (config + model class + `save_pretrained`, safetensors),
so the files are exactly what the hub would hand us, together with a small byte-level BPE
tokenizer trained here with `tokenizers` (no download) that `AutoTokenizer.from_pretrained(dir)`
loads. Built once per process into a temporary directory (removed at exit):

    from tests.support.checkpoints import checkpoint_dir
    path = checkpoint_dir("llama")            # -> Path with config.json, *.safetensors, tokenizer

Names: see CHECKPOINTS. All are fp32 except "llama-bf16".
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_CORPUS = """\
A paged KV cache stores each request's keys and values in fixed-size blocks of a shared pool.
The block table maps logical blocks to physical ones, so memory is allocated as a request grows
and the only waste is the unused tail of its last block. The scheduler batches decodes first,
then prefills under a token budget; when the pool is full the newest request is preempted.
def attention(query, key, value, scale): return softmax(query @ key.T * scale) @ value
for i in range(10): print(i, i * i, "hello world", 3.14159, [1, 2, 3], {"a": 1})
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
"""
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unk, bos, eos


@dataclass(frozen=True)
class CheckpointSpec:
    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "gemma2" | "gemma3"
    config: dict[str, Any] = field(default_factory=dict)  # overrides of _BASE
    dtype: torch.dtype = torch.float32
    max_shard_size: str | None = None  # set: save sharded with model.safetensors.index.json
    seed: int = 0
    # The max_model_len the model tests serve it at (None: the config's), for ropes whose
    # frequencies depend on it (longrope: short factors up to original_max_position_embeddings).
    max_model_len: int | None = None


_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

CHECKPOINTS: dict[str, CheckpointSpec] = {
    "llama": CheckpointSpec("llama", seed=1),
    # Llama 3.1's rope scaling with a small original context, so that within head_dim 16 some
    # frequencies are kept, some divided and some interpolated. One KV head (MQA): at tp = 2
    # it is replicated.
    "llama3-rope": CheckpointSpec(
        "llama",
        dict(
            num_key_value_heads=1,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        seed=2,
    ),  # fmt: skip
    # Tied embeddings, head_dim (32) != hidden / heads (16), biases everywhere Llama allows them.
    "llama-tied": CheckpointSpec(
        "llama",
        dict(tie_word_embeddings=True, head_dim=32, attention_bias=True, mlp_bias=True),
        seed=3,
    ),
    "llama-sharded": CheckpointSpec("llama", max_shard_size="40KB", seed=4),
    "llama-bf16": CheckpointSpec("llama", dtype=torch.bfloat16, seed=5),
    "llama-linear-rope": CheckpointSpec(
        "llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0)), seed=6
    ),
    # A sliding window above every length the tests use (mistral-window: one below them).
    "mistral": CheckpointSpec("mistral", dict(sliding_window=128, head_dim=16), seed=7),
    "qwen2": CheckpointSpec("qwen2", dict(rope_theta=1000000.0), seed=8),
    # Qwen2.5 long context: yarn over an original context of 64 (so some frequencies are kept,
    # some interpolated, some ramped, within head_dim 16), attention factor 0.1·ln 4 + 1.
    "qwen2-yarn": CheckpointSpec(
        "qwen2",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
        seed=9,
    ),
    # Dynamic NTK: served up to max_position_embeddings, where it is the unscaled rope.
    "llama-dynamic": CheckpointSpec(
        "llama", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), seed=10
    ),
    # Qwen3: q/k norms, head_dim 16 with 6 query heads (hidden / heads is not even an integer),
    # 3 per rank at tp = 2.
    "qwen3": CheckpointSpec(
        "qwen3", dict(num_attention_heads=6, head_dim=16, rope_theta=1000000.0), seed=11
    ),
    # Qwen3 with tied embeddings, attention biases, one KV head, head_dim 32 and yarn.
    "qwen3-tied": CheckpointSpec(
        "qwen3",
        dict(
            tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1, head_dim=32,
            rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=128,
                              beta_fast=16, beta_slow=2),
        ),
        seed=12,
    ),  # fmt: skip
    # Phi-3 128k-style longrope: distinct short and long factors, attention factor from
    # max_position_embeddings / original (256 / 64). Served at 64 here: the short factors.
    "phi3": CheckpointSpec(
        "phi3",
        dict(
            original_max_position_embeddings=64,
            rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                              long_factor=[1.5 + 0.5 * i for i in range(8)]),
        ),
        seed=13,
        max_model_len=64,
    ),  # fmt: skip
    # Phi-4-mini-style: partial rotary (12 of 16 dims), tied embeddings, one KV head, no scaling.
    "phi3-partial": CheckpointSpec(
        "phi3",
        dict(partial_rotary_factor=0.75, tie_word_embeddings=True, num_key_value_heads=1),
        seed=14,
    ),
    # Sliding windows of a few tokens, so prompts and generations run several windows long.
    "mistral-window": CheckpointSpec("mistral", dict(sliding_window=8, head_dim=16), seed=9),
    # Alternate local (window 8) and global layers, soft caps near the scores' and logits' size
    # (so tanh bends them), query_pre_attn_scalar != head_dim, tied embeddings (Gemma's default).
    "gemma2": CheckpointSpec(
        "gemma2",
        dict(num_hidden_layers=3, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
             attn_logit_softcapping=2.0, final_logit_softcapping=8.0),
        seed=10,
    ),
    # Five local layers (window 12, rope base 1e4) to one global (base 1e6, linear scaling),
    # q/k norms, head_dim 32 != hidden / heads, untied embeddings.
    "gemma3": CheckpointSpec(
        "gemma3",
        dict(num_hidden_layers=6, head_dim=32, sliding_window=12, query_pre_attn_scalar=32,
             tie_word_embeddings=False,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1000000.0}}),
        seed=11,
    ),
}
# Every Phi-3 checkpoint: the tokenizer's pad id (Phi3Config defaults to 32000) and no window.
_ARCHITECTURE_BASE: dict[str, dict[str, Any]] = {
    "phi3": dict(pad_token_id=0, sliding_window=None),
}


def _classes(architecture: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[architecture]


def build_tokenizer(out_dir: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE on _CORPUS, save it for AutoTokenizer; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out_dir)
    return len(fast)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises biases to 0 and norms to 1, which would leave those code paths
    # untested; and std 0.02 gives near-uniform logits. Every parameter gets a distinct value.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = torch.rand(param.shape, generator=generator) * 0.4 + 0.8
            else:
                noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(noise.to(param.dtype))


def build_checkpoint(out_dir: Path, spec: CheckpointSpec) -> Path:
    """Write the checkpoint described by `spec` (weights, config, tokenizer) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(out_dir)
    config_class, model_class = _classes(spec.architecture)
    config = config_class(**{**_BASE, **_ARCHITECTURE_BASE.get(spec.architecture, {}),
                             "vocab_size": vocab_size, **spec.config})
    model = model_class(config)
    _randomise(model, spec.seed)
    model = model.to(spec.dtype)
    kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="raypaged-checkpoints-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def checkpoint_dir(name: str) -> Path:
    """The directory of checkpoint `name` (built on first use in this process)."""
    if name not in CHECKPOINTS:
        raise KeyError(f"unknown test checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}")
    return build_checkpoint(_root() / name, CHECKPOINTS[name])


def copy_checkpoint(name: str, dest: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """A private copy of checkpoint `name` in `dest`, optionally edited (for negative tests)."""
    shutil.copytree(checkpoint_dir(name), dest)
    if edit is not None:
        edit(dest)
    return dest


def roomy_llama(dest: Path, max_position_embeddings: int = 4096) -> Path:
    """A copy of the llama checkpoint whose context holds thousands of tokens: requests that
    run long enough for a test to act while they are in flight."""
    def roomy(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config["max_position_embeddings"] = max_position_embeddings
        (path / "config.json").write_text(json.dumps(config))

    return copy_checkpoint("llama", dest, roomy)


def demo_model_missing() -> bool:
    from raypaged.demo import demo_model_path

    try:
        demo_model_path()
    except FileNotFoundError:
        return True
    return False
