"""The committed demo model: complete, loadable by transformers, and trained rather than noise.

Every check of "trained" is made against a randomly initialised model of the same config, which
must fail it: a check that the random model also passes would prove nothing.
"""

from __future__ import annotations

import json
import math
import re
import sysconfig
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import raypaged.demo as demo
from raypaged.demo import DEMO_MODEL_DIR, DEMO_MODEL_FILES, demo_model_path

PYTHON_MARKERS = ("(", ":", "self", "return", " = ")
# "def " + a name + "(" : how nearly every def in the stdlib goes on.
DEF_SIGNATURE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\(")
# "import " + dotted module names (optionally "as x") + end of line.
IMPORT_LINE = re.compile(r"^[A-Za-z_][\w.]*( as \w+)?(, [A-Za-z_][\w.]*( as \w+)?)*\n")
NEW_TOKENS = 24
HELD_OUT_TOKENS = 512


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def trained_model():
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def random_model(trained_model):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(trained_model.config, dtype=torch.float32)
    return model.eval()


def greedy_continuation(model, tokenizer, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def held_out_ids(tokenizer) -> torch.Tensor:
    """Tokens of stdlib files the build script held out of training (by name, see its docstring)."""
    info = json.loads((DEMO_MODEL_DIR / "training_info.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    present = [stdlib / name for name in info["held_out_files"] if (stdlib / name).is_file()]
    assert present, f"none of the held-out files {info['held_out_files']} is in {stdlib}"
    assert not set(p.name for p in present) & set(info["train_files"])
    ids: list[int] = []
    for path in present:
        ids += tokenizer(path.read_text(encoding="utf-8", errors="replace"), verbose=False).input_ids
        if len(ids) >= HELD_OUT_TOKENS:
            break
    return torch.tensor([ids[:HELD_OUT_TOKENS]])


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return math.exp(model(input_ids=ids, labels=ids).loss.item())


def test_demo_model_path_returns_the_committed_directory():
    path = Path(demo_model_path())
    assert path == DEMO_MODEL_DIR and path.is_dir()
    for name in DEMO_MODEL_FILES:
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < 8 * 1024 * 1024


def test_demo_model_path_names_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        demo.demo_model_path()
    absent = ", ".join(name for name in DEMO_MODEL_FILES if name != "config.json")
    assert f"missing {absent};" in str(err.value)
    assert "make_demo_model.py" in str(err.value)


def test_config_is_a_small_gqa_llama_with_tied_embeddings(tokenizer):
    config = AutoConfig.from_pretrained(demo_model_path())
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.hidden_size // config.num_attention_heads in (32, 64, 128)
    assert config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings == 1024
    generation = GenerationConfig.from_pretrained(demo_model_path())
    for cfg in (config, generation):
        assert cfg.bos_token_id == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids("<s>")
        assert cfg.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("</s>")
    assert tokenizer.bos_token_id != tokenizer.eos_token_id


def test_weights_are_stored_in_half_precision():
    from safetensors import safe_open

    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        # Tied: the checkpoint has the embedding and no separate lm_head.
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    assert dtypes == {"BF16"}


@pytest.mark.parametrize("text", [
    "def naïve(x):\n\treturn f'{x} → ∞'  # 日本語, emoji 🐍, Ελληνικά\r\n",
    "   leading and trailing spaces   ",
    "\x00\x7f control bytes and a lone combining mark \u0301",
])
def test_tokenizer_round_trips_utf8(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_multibyte_character_split_across_tokens_still_round_trips(tokenizer):
    # A character the BPE never merged is spelt as several byte tokens; only the whole decodes.
    ids = tokenizer("🐍", add_special_tokens=False).input_ids
    assert len(ids) > 1
    assert tokenizer.decode(ids) == "🐍"
    assert tokenizer.decode(ids[:1]) != "🐍"


def test_prompts_start_with_bos_and_keep_a_trailing_space_on_the_word(tokenizer):
    ids = tokenizer("def ").input_ids
    assert ids[0] == tokenizer.bos_token_id
    # "def " is one token, as it is inside training text, so the prompt ends where code would.
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == ["def\u0120"]


def test_greedy_continuation_of_def_looks_like_python(trained_model, random_model, tokenizer):
    trained = greedy_continuation(trained_model, tokenizer, "def ")
    untrained = greedy_continuation(random_model, tokenizer, "def ")
    assert any(marker in trained for marker in PYTHON_MARKERS), trained
    assert DEF_SIGNATURE.match(trained), trained
    assert not DEF_SIGNATURE.match(untrained), untrained
    assert sum(untrained.count(m) for m in PYTHON_MARKERS) < sum(trained.count(m) for m in PYTHON_MARKERS)


def test_greedy_continuation_of_import_is_a_module_name_then_a_newline(trained_model, random_model,
                                                                       tokenizer):
    trained = greedy_continuation(trained_model, tokenizer, "import ")
    untrained = greedy_continuation(random_model, tokenizer, "import ")
    assert IMPORT_LINE.match(trained), trained
    assert not IMPORT_LINE.match(untrained), untrained


def test_held_out_stdlib_perplexity_is_far_below_a_random_model(trained_model, random_model, tokenizer):
    ids = held_out_ids(tokenizer)
    trained, untrained = perplexity(trained_model, ids), perplexity(random_model, ids)
    # A random model is about uniform over the vocabulary; the trained one must be >20x better.
    assert untrained > 0.5 * len(tokenizer)
    assert trained * 20 < untrained, (trained, untrained)
