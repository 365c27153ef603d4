"""Tokenizers of any vocabulary size for random-weights models, which have none (and nothing can
be downloaded).

Benchmarks that only detokenize make do with one word per id (write_word_level_tokenizer:
bench_serving's). A grammar engine needs more: a vocabulary whose tokens are strings, as a real
model's are, so that a JSON schema's mask has punctuation, digits, quotes and word pieces to
choose among. write_byte_level_tokenizer's has the 256 byte tokens
(GPT-2's byte-to-unicode alphabet, as Llama 3's and Qwen's vocabularies) and then, up to the size
asked, pieces drawn reproducibly: JSON punctuation runs, numbers, and letter strings of 2 to 9
characters with and without a leading space or capital. No merges: encoding gives bytes, and
every id decodes to its piece, which is all a constrained decode of a random model uses.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

PUNCTUATION = ['{', '}', '[', ']', '"', ':', ',', '{"', '"}', '":', '",', '":"', '","', '"]',
               '["', '},', '],', ' {', ' [', ' "', '": ', '", "', '":{', '":[', '}}', ']}', '\n',
               '  ', '    ', 'true', 'false', 'null', ' true', ' false', ' null', '.', '-', '_']


def _pieces(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces: dict[str, None] = dict.fromkeys(PUNCTUATION)
    pieces.update(dict.fromkeys(str(n) for n in range(1000)))
    letters = string.ascii_lowercase
    while len(pieces) < count:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        form = rng.random()
        if form < 0.3:
            word = word.capitalize()
        if rng.random() < 0.5:
            word = " " + word
        pieces[word] = None
    return list(pieces)[:count]


def write_byte_level_tokenizer(directory: Path, vocab_size: int, seed: int = 0) -> None:
    """Save a PreTrainedTokenizerFast of exactly `vocab_size` ids into `directory`: the byte
    tokens, then pieces, the last id its EOS ("<|eos|>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"a byte-level vocabulary needs at least {len(alphabet) + 2} ids")
    to_unicode = _bytes_to_unicode()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for piece in _pieces(vocab_size - len(vocab) - 1, seed):
        encoded = "".join(to_unicode[b] for b in piece.encode())
        if encoded not in vocab:
            vocab[encoded] = len(vocab)
    filler = 0
    while len(vocab) < vocab_size - 1:  # a piece equal to a byte token: fill with fresh ones
        vocab["".join(to_unicode[b] for b in f"~{filler}".encode())] = len(vocab)
        filler += 1
    vocab["<|eos|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>").save_pretrained(directory)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters, which ByteLevel pieces are written in."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


def write_word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id of the model's vocabulary: `raypaged launch`
    needs a tokenizer to detokenize the stream, and a random-weights model dir has none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(directory)
