"""Incremental detokenizer and stop-string matcher: streamed text equals decoding the whole
output, for byte-level BPE (GPT-2 / Llama 3 style) and byte-fallback SentencePiece-style BPE
(Llama 2 style) tokenizers, with characters split across tokens and tokens pushed in chunks."""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from raypaged.text.detokenizer import IncrementalDetokenizer
from raypaged.text.stop_strings import StopStringMatcher

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello world, hello there; def f(x): return x * 2",
    "A paged KV cache stores keys and values in fixed-size blocks.",
] * 3
_SAMPLES = ["héllo 日本 world 😀", "naïve café — 東京タワー 🚀🚀", "plain ascii text", "ü", "a😀b",
            "\u00e9\u0301"]


@functools.cache
def byte_level_tokenizer():
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    from tests.support.checkpoints import build_tokenizer

    path = Path(tempfile.mkdtemp(prefix="raypaged-detok-"))
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@functools.cache
def byte_fallback_tokenizer():
    """Llama 2 style: '▁' for spaces, <0xNN> byte tokens, a decoder that strips one leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    # The 256 byte tokens are ordinary vocabulary (not special), as in Llama 2's.
    vocab = trained.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(trained.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


TOKENIZERS = {"byte_level": byte_level_tokenizer, "byte_fallback": byte_fallback_tokenizer}


def stream(tokenizer, prompt_ids, output_ids, chunks, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas, i = [], 0
    for size in chunks:
        if i >= len(output_ids):
            break
        deltas.append(detok.push(output_ids[i:i + size]))
        i += size
    if i < len(output_ids):
        deltas.append(detok.push(output_ids[i:]))
    deltas.append(detok.flush())
    return deltas


def expected_text(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> str:
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)

    prompt_text = decode(prompt_ids)
    full = decode(list(prompt_ids) + list(output_ids))
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", _SAMPLES)
def test_one_token_at_a_time_equals_whole_decode(name, text):
    tokenizer = TOKENIZERS[name]()
    prompt_ids = tokenizer.encode("hello there", add_special_tokens=False)
    output_ids = tokenizer.encode(" " + text, add_special_tokens=False)
    assert len(output_ids) > len(text.split()), "the sample should split characters across tokens"
    deltas = stream(tokenizer, prompt_ids, output_ids, [1] * len(output_ids))
    assert "".join(deltas) == expected_text(tokenizer, prompt_ids, output_ids)
    # Split characters are held back, never streamed as U+FFFD.
    assert all("\ufffd" not in d for d in deltas)


def test_split_character_is_held_back_then_released_whole():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("日", add_special_tokens=False)
    assert len(ids) == 3  # three UTF-8 bytes, three byte tokens: nothing merged them
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push([t]) for t in ids] == ["", "", "日"]
    assert detok.flush() == ""


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_prompt_context_starting_inside_a_character(name):
    """The last prompt tokens begin with the tail of a split character: the context must skip
    it, or a byte-fallback decoder would turn the output's bytes into U+FFFD too."""
    tokenizer = TOKENIZERS[name]()

    def encode(text):  # without the byte-fallback tokenizer's prepended "▁"
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[1:] if tokenizer.convert_ids_to_tokens(ids[:1]) == ["▁"] else ids

    ri = encode("日")
    assert len(ri) == 3  # three byte tokens
    prompt_ids = ri[1:] + ri  # the tail of a split 日, then a whole one: the last 5 start mid-run
    output_ids = encode("本x")
    assert "".join(stream(tokenizer, prompt_ids, output_ids, [1] * 5)) == "本x"


def test_leading_space_kept_from_prompt_context():
    tokenizer = byte_fallback_tokenizer()
    prompt_ids = tokenizer.encode("hello", add_special_tokens=False)
    output_ids = tokenizer.encode("world", add_special_tokens=False)  # "▁world": a leading space
    # Decoded alone the output's first token loses its leading space (the Strip decoder).
    assert tokenizer.decode(output_ids) == "world"
    assert "".join(stream(tokenizer, prompt_ids, output_ids, [1] * 10)) == " world"


def test_incomplete_bytes_are_flushed_at_the_end():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("日", add_special_tokens=False)[:2]  # a character cut short
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.push(ids) == ""
    assert detok.flush() == tokenizer.decode(ids) == "\ufffd"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip):
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("hello", add_special_tokens=False) + [tokenizer.eos_token_id]
    text = "".join(stream(tokenizer, [], ids, [1] * len(ids), skip_special_tokens=skip))
    assert text == ("hello" if skip else "hello</s>")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_random_chunks_equal_whole_decode(data):
    """Any id sequence, valid UTF-8 or not, pushed in any chunking: byte-level decoding is lossy
    per character, so the joined deltas must equal decoding everything at once. (The prompt
    ends on a whole character, as a text prompt always does.)"""
    tokenizer = byte_level_tokenizer()
    vocab = len(tokenizer)
    ids = st.integers(min_value=0, max_value=vocab - 1)
    skip = data.draw(st.booleans())
    prompt_ids = data.draw(st.lists(ids, max_size=8))
    # Whole as decoded with the same skipping: a skipped special token may be all that ends it.
    assume(not tokenizer.decode(prompt_ids, skip_special_tokens=skip).endswith("\ufffd"))
    output_ids = data.draw(st.lists(ids, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    deltas = stream(tokenizer, prompt_ids, output_ids, chunks, skip)
    assert "".join(deltas) == expected_text(tokenizer, prompt_ids, output_ids, skip)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_long_output_window_trimmed(name):
    """Hundreds of tokens: the window is trimmed as it moves, and the text still joins up."""
    import random

    tokenizer = TOKENIZERS[name]()
    rng = random.Random(0)
    text = "".join(rng.choice(["hello ", "日本", "world ", "é", "😀", "fox. "]) for _ in range(150))
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(output_ids) > 300
    chunks = [rng.randint(1, 3) for _ in range(len(output_ids))]
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = []
    for size in chunks:
        deltas.append(detok.push(output_ids[detok.num_output_tokens:detok.num_output_tokens + size]))
        assert len(detok._ids) < 100  # a bounded window, not the whole output
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(output_ids, clean_up_tokenization_spaces=False)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab xy.日本éü😀🚀—")), max_size=30),
       chunks=st.lists(st.integers(1, 3), max_size=30), name=st.sampled_from(sorted(TOKENIZERS)))
def test_random_text_random_chunks(text, chunks, name):
    tokenizer = TOKENIZERS[name]()
    prompt_ids = tokenizer.encode("hello", add_special_tokens=False)
    output_ids = tokenizer.encode(" " + text, add_special_tokens=False)
    deltas = stream(tokenizer, prompt_ids, output_ids, chunks)
    assert "".join(deltas) == expected_text(tokenizer, prompt_ids, output_ids)
    assert all("\ufffd" not in d for d in deltas[:-1])


# ---- stop strings ----------------------------------------------------------------------------

def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_string_split_across_deltas_is_never_leaked():
    matcher = StopStringMatcher(["<|end|>"])
    assert matcher.feed("hello <|e") == ("hello ", None)  # "<|e" held back
    assert matcher.feed("nd|> more") == ("", "<|end|>")


def test_held_text_released_when_it_stops_matching():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", None)
    assert matcher.feed("ART") == ("START", None)
    assert matcher.feed("x") == ("x", None)
    assert matcher.flush() == ""


def test_earliest_match_wins_and_longer_at_the_same_place():
    assert StopStringMatcher(["world", "lo"]).feed("hello world") == ("hel", "lo")
    assert StopStringMatcher(["ab", "abc"]).feed("xxabcd") == ("xx", "abc")


def test_flush_releases_a_partial_match_at_the_end():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line\n") == ("line", None)
    assert matcher.flush() == "\n"


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_matcher_equals_search_on_the_text_so_far(text, stops, cuts):
    """However the text is cut into deltas, the output ends at the first delta that completes a
    stop string, before the earliest stop string in the text so far (the longest at that
    position); and it is all the text when none occurs."""
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    got = feed_all(StopStringMatcher(stops), pieces)
    for end in bounds[1:]:
        seen = text[:end]
        hits = [(seen.find(s), -len(s), s) for s in stops if s in seen]
        if hits:
            index, _, stop = min(hits)
            assert got == (text[:index], stop)
            return
    assert got == (text, None)
