"""bench_structured's pieces: the synthetic tokenizer is a byte-level vocabulary of exactly the
size asked that xgrammar reads as one, and the window's schema cannot end inside a window."""

from __future__ import annotations

import json

import xgrammar as xgr

from benchmarks.bench_structured import random_schema, records_schema
from benchmarks.lib.synthetic_tokenizer import write_byte_level_tokenizer


def test_synthetic_tokenizer_has_the_size_and_pieces_a_grammar_needs(tmp_path):
    from transformers import AutoTokenizer

    write_byte_level_tokenizer(tmp_path, 1000)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == 999
    pieces = {tokenizer.decode([i]) for i in range(999)}
    assert {"{", '":', '"', "true", "42"} <= pieces and any(p.startswith(" ") for p in pieces)
    assert tokenizer.decode(tokenizer.encode('{"a": [1, "b"]}')) == '{"a": [1, "b"]}'
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=1000, stop_token_ids=[999])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(records_schema(3)), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    # One record of the three min_items asks for: the list cannot close yet.
    assert matcher.accept_string('{"items": [{"id": 1, "name": "x", "tags": [], "ok": true}')
    assert not matcher.accept_string("]")
    assert matcher.accept_string(",")


def test_random_schemas_are_json_schemas_xgrammar_accepts():
    import random

    rng = random.Random(0)
    for _ in range(20):
        xgr.Grammar.from_json_schema(json.dumps(random_schema(rng)))
