"""Random JSON schemas for constrained-decoding tests, and the reader of what a random model writes."""

from __future__ import annotations

import json
import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random schema of nested objects, arrays, enums and required fields, small enough that
    a random model's greedy walk through it usually ends within ~160 tokens."""
    kinds = ["integer", "boolean", "enum", "string"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yz"], rng.randint(1, 3))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 4)}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 2)}
    if kind == "object":
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": rng.sample(names, rng.randint(1, len(names))),
                "additionalProperties": False}
    return {"type": kind}


def parse(text: str):
    # xgrammar's JSON grammar lets raw control characters (< 0x20) into strings, which strict
    # JSON refuses; a random model emits them. strict=False reads them; all else is checked.
    return json.loads(text, strict=False)
