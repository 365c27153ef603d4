"""The functions that chain a full block's contents into its prefix-cache hash value.

A block's hash value stands for its whole prefix: it mixes the parent block's value, the block's
token ids and its extra keys (a tenant's cache salt, a KV-cache group's index). Two algorithms:

- "builtin": Python's `hash()` of the tuple. Fast, but a tuple holding a string (a salt) hashes
  differently in every process (PYTHONHASHSEED), so its values mean nothing outside the engine.
- "sha256": SHA-256 of a canonical byte encoding (`encode_block`), the full 256-bit digest as an
  int. The same in every process and on every machine, so a frontend can hash a prompt with this
  chain and compare its values with what engines report (frontend/prefix_router.py); and a tenant
  cannot engineer a prompt whose hash collides with another tenant's prefix.

Either way a prefix-cache hit also compares the block's tokens and keys exactly (BlockHash), so
the algorithm decides which processes can compare values, never which tokens a hit returns.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import struct
from collections.abc import Callable, Hashable
from typing import Any

# parent value, token ids, extra keys -> the block's hash value.
BlockHasher = Callable[[int, tuple[int, ...], "tuple[Hashable, ...] | None"], int]

HASH_ALGOS = ("builtin", "sha256")
DEFAULT_HASH_ALGO = "sha256"

# The "parent value" of a request's first block. Any fixed int works (a hit compares the tokens).
ROOT_HASH = 0x5EED_B10C_4A5E
_MASK_256 = (1 << 256) - 1


def _builtin_sha256() -> Callable[[bytes], Any]:
    """CPython's own SHA-256 (the module hashlib falls back to), else hashlib's OpenSSL one.
    The same digests; for a ~100-byte block CPython's costs about half as much when its code is
    not in the CPU's caches, as in a scheduler step that touches hundreds of requests in between
    (OpenSSL's goes through its EVP dispatch on every call)."""
    for name in ("_sha2", "_sha256"):  # 3.12+, 3.11
        try:
            return importlib.import_module(name).sha256  # type: ignore[no-any-return]
        except (ImportError, AttributeError):
            continue
    return hashlib.sha256


_sha256 = _builtin_sha256()


def builtin_block_hash(parent: int, token_ids: tuple[int, ...],
                       extra_keys: tuple[Hashable, ...] | None) -> int:
    return hash((parent, token_ids, extra_keys))


def _encode_key(key: Hashable) -> bytes:
    # A type tag and a length before each key: ("a", "bc") and ("ab", "c") encode apart.
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(data)) + data
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"a block's extra keys are str or int, got {type(key).__name__}")
    return b"i" + key.to_bytes(16, "little", signed=True)


@functools.lru_cache(maxsize=4096)
def _encode_keys(extra_keys: tuple[Hashable, ...] | None) -> bytes:
    # A request's every block carries the same keys (its salt): encoded once.
    if not extra_keys:
        return b"\x00"
    return b"\x01" + b"".join(map(_encode_key, extra_keys))


_packers: dict[int, Callable[..., bytes]] = {}  # token count -> struct.pack of count and ids
_from_bytes = int.from_bytes


def _packer(num_tokens: int) -> Callable[..., bytes]:
    pack = _packers[num_tokens] = struct.Struct(f"<I{num_tokens}I").pack
    return pack


def encode_block(parent: int, token_ids: tuple[int, ...],
                 extra_keys: tuple[Hashable, ...] | None) -> bytes:
    """The canonical bytes of one block: the parent's value (32 bytes, two's complement over 256
    bits: a builtin-chain root or value may be negative), the token count and ids (uint32, little
    endian), then each extra key tagged with its type."""
    return ((parent & _MASK_256).to_bytes(32, "little")
            + (_packers.get(len(token_ids)) or _packer(len(token_ids)))(len(token_ids), *token_ids)
            + _encode_keys(extra_keys))


def sha256_block_hash(parent: int, token_ids: tuple[int, ...],
                      extra_keys: tuple[Hashable, ...] | None) -> int:
    """SHA-256 of encode_block(parent, token_ids, extra_keys), as an int. The encoding is
    inlined (one call, no cache lookups for the common unsalted block): a block fills, and is
    hashed, for some request nearly every step."""
    num = len(token_ids)
    pack = _packers.get(num) or _packer(num)
    keys = _encode_keys(extra_keys) if extra_keys else b"\x00"
    return _from_bytes(_sha256((parent & _MASK_256).to_bytes(32, "little") + pack(num, *token_ids) + keys)
                       .digest(), "little")


def block_hasher(algo: str) -> BlockHasher:
    if algo == "builtin":
        return builtin_block_hash
    if algo == "sha256":
        return sha256_block_hash
    raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def request_extra_keys(cache_salt: str | None) -> tuple[str, ...] | None:
    """The extra keys of every block of a request with this salt. The salt goes into every block,
    not only the first: tenants stay apart even if two prefixes' chained values ever collided."""
    return (cache_salt,) if cache_salt else None


def prefix_hash_values(token_ids: list[int] | tuple[int, ...], block_size: int, cache_salt: str | None,
                       hasher: BlockHasher) -> list[int]:
    """The hash values of the full blocks of `token_ids`, leading block first: the values an
    engine's KVCacheManager gives the same blocks of a request with this salt."""
    keys = request_extra_keys(cache_salt)
    values: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, tuple(token_ids[start:start + block_size]), keys)
        values.append(parent)
    return values
