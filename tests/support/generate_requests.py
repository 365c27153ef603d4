"""GenerateRequest messages for fuzzing the gRPC API, every field from valid through absurd
(generate_requests, a hypothesis strategy), and the oracle that says which of them the API
must refuse with INVALID_ARGUMENT (expected_refusal), written from the proto comments and the
README. Sized for the tiny llama checkpoint (tests/support/checkpoints.py): its context and
vocabulary are MAX_MODEL_LEN and VOCAB, which tests/reliability/test_fuzz.py's server checks.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from raypaged.proto.v1 import raypaged_pb2 as pb

MAX_MODEL_LEN = 256  # the tiny checkpoint's context
VOCAB = 320


# ---- the oracle: the API's limits, written from the proto comments and the README ------------

def expected_refusal(m: pb.GenerateRequest, tokenizer) -> str | None:
    """Why the request must be refused (INVALID_ARGUMENT), or None when it must be served."""
    sp = m.sampling_params
    has = sp.HasField
    text, ids = m.prompt, list(m.prompt_token_ids)
    if text and ids:
        return "prompt given both ways"
    if not text and not ids:
        return "empty prompt"
    rid = m.request_id
    if rid and (len(rid) > 128 or not rid.isprintable() or rid.isspace() or "#" in rid):
        return "bad request_id"
    if len(m.cache_salt) > 256:
        return "cache_salt too long"
    if text:
        if len(text) > MAX_MODEL_LEN * 64:
            return "text prompt too long"
        num_prompt = len(tokenizer.encode(text))
    else:
        num_prompt = len(ids)
        if num_prompt < MAX_MODEL_LEN and any(not 0 <= t < VOCAB for t in ids):
            return "prompt id outside the vocabulary"
    if num_prompt >= MAX_MODEL_LEN:
        return "prompt fills the context"
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if has(name) and not math.isfinite(getattr(sp, name)):
            return f"{name} not finite"
    room = MAX_MODEL_LEN - num_prompt
    max_tokens = sp.max_tokens if has("max_tokens") else min(16, room)
    checks = [
        (1 <= (sp.n if has("n") else 1) <= 16, "n"),
        (1 <= max_tokens <= room, "max_tokens"),
        (len(sp.stop) <= 16 and all(1 <= len(s) <= 256 for s in sp.stop), "stop"),
        (len(sp.stop_token_ids) <= 64 and all(0 <= t < VOCAB for t in sp.stop_token_ids), "stop_token_ids"),
        (0 <= (sp.min_tokens if has("min_tokens") else 0) <= max_tokens, "min_tokens"),
        (not has("temperature") or sp.temperature >= 0, "temperature"),
        (not has("top_p") or 0 < sp.top_p <= 1, "top_p"),
        (not has("top_k") or sp.top_k >= -1, "top_k"),
        (not has("min_p") or 0 <= sp.min_p <= 1, "min_p"),
        (not has("repetition_penalty") or sp.repetition_penalty > 0, "repetition_penalty"),
        (not has("presence_penalty") or -2 <= sp.presence_penalty <= 2, "presence_penalty"),
        (not has("frequency_penalty") or -2 <= sp.frequency_penalty <= 2, "frequency_penalty"),
        (not has("logprobs") or 0 <= sp.logprobs <= 20, "logprobs"),
    ]
    return next((f"bad {name}" for ok, name in checks if not ok), None)


# ---- generated requests ------------------------------------------------------------------------

INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)


def around(low: int, high: int) -> st.SearchStrategy[int]:
    """Mostly near the valid range, sometimes anywhere in int32."""
    return st.one_of(st.integers(low - 3, high + 3), INT32)


def floats_around(low: float, high: float) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(low - 1, high + 1), ANY_FLOAT)


TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, VOCAB + 3), INT32)
TEXT = st.text(max_size=60)  # any code point, surrogates excluded (protobuf strings are UTF-8)
LONG_TEXT = st.text(min_size=250, max_size=260)  # around the 256-character limits
NAME_TEXT = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", max_size=20)
# Per optional field: values a client would send, and anything at all.
OPTIONAL_FIELDS = {
    "n": (st.integers(1, 3), around(1, 16)),
    "max_tokens": (st.integers(1, 24), around(1, MAX_MODEL_LEN)),
    "min_tokens": (st.integers(0, 2), around(0, 8)),
    "temperature": (st.floats(0, 2), floats_around(0, 2)),
    "top_p": (st.floats(0.05, 1), floats_around(0, 1)),
    "top_k": (st.integers(-1, VOCAB + 5), around(-1, VOCAB + 5)),
    "min_p": (st.floats(0, 1), floats_around(0, 1)),
    "repetition_penalty": (st.floats(0.5, 2), floats_around(0, 2)),
    "presence_penalty": (st.floats(-2, 2), floats_around(-2, 2)),
    "frequency_penalty": (st.floats(-2, 2), floats_around(-2, 2)),
    "seed": (INT64, INT64),
    "logprobs": (st.integers(0, 5), around(0, 20)),
    "skip_special_tokens": (st.booleans(), st.booleans()),
}
FIELDS = {  # the message's other fields: (sensible, anything)
    "prompt_token_ids": (st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40),
                         st.one_of(st.lists(TOKEN_IDS, max_size=40),
                                   st.integers(MAX_MODEL_LEN - 3, MAX_MODEL_LEN + 3).map(lambda k: [7] * k))),
    "prompt": (st.text(min_size=1, max_size=200),
               st.one_of(TEXT, st.sampled_from([MAX_MODEL_LEN * 64, MAX_MODEL_LEN * 64 + 1]).map("x".__mul__))),
    "request_id": (st.one_of(st.just(""), NAME_TEXT), st.one_of(TEXT, st.text(min_size=120, max_size=140))),
    "cache_salt": (st.one_of(st.just(""), NAME_TEXT), st.one_of(TEXT, LONG_TEXT)),
    "stop": (st.lists(st.text(min_size=1, max_size=8), max_size=3),
             st.lists(st.one_of(TEXT, LONG_TEXT), max_size=18)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(TOKEN_IDS, max_size=66)),
}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A third: every field anything. Otherwise a request a client would send, half of them
    with one or two fields then set to anything (the usual mistake is one bad value)."""
    wild = draw(st.integers(0, 2)) == 0
    mutated = set() if wild else set(draw(st.lists(st.sampled_from([*FIELDS, *OPTIONAL_FIELDS]), max_size=2)))

    def value(table: dict, name: str):
        sensible, anything = table[name]
        return draw(anything if wild or name in mutated else sensible)

    m = pb.GenerateRequest()
    as_text = draw(st.booleans())
    if wild or "prompt" in mutated or not as_text:
        m.prompt_token_ids.extend(value(FIELDS, "prompt_token_ids"))
    if wild or "prompt_token_ids" in mutated or as_text:
        m.prompt = value(FIELDS, "prompt")
    if wild and draw(st.booleans()):  # sometimes one of the two only, sometimes neither
        m.ClearField(draw(st.sampled_from(["prompt", "prompt_token_ids"])))
    m.request_id = value(FIELDS, "request_id")
    m.cache_salt = value(FIELDS, "cache_salt")
    m.priority = draw(INT32)
    sp = m.sampling_params
    for name in OPTIONAL_FIELDS:
        if name in mutated or draw(st.booleans()):
            setattr(sp, name, value(OPTIONAL_FIELDS, name))
    sp.stop.extend(value(FIELDS, "stop"))
    sp.stop_token_ids.extend(value(FIELDS, "stop_token_ids"))
    sp.ignore_eos = draw(st.booleans())
    return m
