"""The API keys file (`--api-keys-file`, a Serve app's `api_keys_file`): YAML, one entry per key.

    keys:
      "sk-team-a-3f9c1e7d5b2a4c6e":      # the key clients send: Authorization: Bearer <key>
        name: team-a                      # required; metric label; [A-Za-z0-9._-], 1-64 chars
        requests_per_second: 5            # optional limits (absent: none of that kind)
        burst: 10                         #   requests at once before the rate paces them
        tokens_per_minute: 200000         #   prompt + generated tokens
        max_concurrent: 8                 #   requests in flight at once
        priority: 0                       # lower is earlier (with --scheduling-policy priority)
      "sk-batch-0d8e2f4a6c1b3e5d":
        name: batch
        priority: 10

JSON is YAML too: the same structure as a JSON object reads the same. Keys must be unique, at
least 16 printable ASCII characters without spaces; names unique. Anything else — an unknown
field, a wrong type, a duplicate — fails at start with a KeysFileError naming the file, the line
and the field; no message ever quotes a key. A file that other users may read is warned about
(it holds secrets: chmod 600).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Any

import yaml

from raypaged.frontend.tenants import Tenant, TenantLimits, TenantRegistry, check_key

logger = logging.getLogger(__name__)
TOP_LEVEL = ("keys",)


class KeysFileError(ValueError):
    """A keys file that cannot be read or does not say what it must."""


@dataclass(frozen=True)
class _Field:
    kind: type  # int or float; bool is refused for both
    minimum: float  # the smallest value allowed
    exclusive: bool = False  # minimum itself not allowed


# The fields of one key's entry beside its name, by TenantLimits / Tenant field.
FIELDS = {
    "requests_per_second": _Field(float, 0, exclusive=True),
    "burst": _Field(int, 1),
    "tokens_per_minute": _Field(int, 1),
    "max_concurrent": _Field(int, 1),
    "priority": _Field(int, -(2**31)),
}


def load_keys_file(path: str) -> TenantRegistry:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KeysFileError(f"cannot read the API keys file {path}: {getattr(e, 'strerror', None) or e}") from None
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("the API keys file %s may be read by other users of this machine (chmod 600 it)", path)
    return parse_keys(text, path)


def parse_keys(text: str, source: str = "<api keys>") -> TenantRegistry:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise KeysFileError(f"{source}{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    if root is None:
        raise KeysFileError(f"{source}: the file is empty; it needs a 'keys:' mapping")
    top = _mapping(root, source, "the file")
    for name, (node, _) in top.items():
        if name not in TOP_LEVEL:
            raise _error(source, node, f"unknown top-level field {name!r}; the file holds {list(TOP_LEVEL)}")
    if "keys" not in top:
        raise _error(source, root, "no 'keys:' mapping")
    key_node, keys = top["keys"]
    entries = _mapping(keys, source, "keys")
    if not entries:
        raise _error(source, key_node, "keys: no key is given")
    tenants: dict[str, Tenant] = {}
    names: dict[str, int] = {}
    for key, (node, value) in entries.items():
        try:
            check_key(key)
        except ValueError as e:
            raise _error(source, node, f"keys: {e}") from None
        tenant = _tenant(value, source)
        line = value.start_mark.line + 1
        if tenant.name in names:
            raise _error(source, value, f"name: {tenant.name!r} is already the name of the key at "
                                        f"line {names[tenant.name]}; names must be unique")
        names[tenant.name] = line
        tenants[key] = tenant
    return TenantRegistry(tenants)


def _tenant(node: yaml.Node, source: str) -> Tenant:
    fields = _mapping(node, source, "a key's entry")
    values: dict[str, Any] = {}
    for field, (field_node, value_node) in fields.items():
        if field == "name":
            continue
        spec = FIELDS.get(field)
        if spec is None:
            raise _error(source, field_node, f"unknown field {field!r}; known: {['name', *FIELDS]}")
        values[field] = _number(field, spec, value_node, source)
    if "name" not in fields:
        raise _error(source, node, "name: every key needs a name")
    name_node = fields["name"][1]
    name = _scalar(name_node)
    if not isinstance(name, str):
        raise _error(source, name_node, f"name: must be a string, got {name!r}")
    if "burst" in values and "requests_per_second" not in values:
        raise _error(source, fields["burst"][0], "burst: needs requests_per_second")
    priority = values.pop("priority", 0)
    try:
        return Tenant(name, TenantLimits(**values), priority)
    except ValueError as e:
        raise _error(source, name_node, f"name: {e}") from None


def _number(field: str, spec: _Field, node: yaml.Node, source: str) -> float | int:
    value = _scalar(node)
    ok_type = isinstance(value, int) or (spec.kind is float and isinstance(value, float))
    if isinstance(value, bool) or not ok_type or value != value:  # value != value: NaN
        kind = "an integer" if spec.kind is int else "a number"
        raise _error(source, node, f"{field}: must be {kind}, got {value!r}")
    if value < spec.minimum or (spec.exclusive and value == spec.minimum) or value == float("inf"):
        bound = f"> {spec.minimum:g}" if spec.exclusive else f">= {spec.minimum:g}"
        raise _error(source, node, f"{field}: must be {bound} and finite, got {value!r}")
    return float(value) if spec.kind is float else int(value)


def _mapping(node: yaml.Node, source: str, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """A mapping node's entries: name → (its key node, its value node); duplicates refused."""
    if not isinstance(node, yaml.MappingNode):
        raise _error(source, node, f"{what} must be a mapping")
    entries: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for key_node, value_node in node.value:
        key = _scalar(key_node)
        if not isinstance(key, str):
            raise _error(source, key_node, f"{what}: every key must be a string")
        if key in entries:
            first = entries[key][0].start_mark.line + 1
            # Never an API key in a message.
            named = "the same API key" if what == "keys" else repr(key)
            raise _error(source, key_node, f"{what}: {named} is given twice (first at line {first})")
        entries[key] = (key_node, value_node)
    return entries


class _Composite:
    """Stands for a mapping or a list where a plain value belongs (named in the message)."""

    def __init__(self, node: yaml.Node) -> None:
        self.kind = "a mapping" if isinstance(node, yaml.MappingNode) else "a list"

    def __repr__(self) -> str:
        return self.kind


def _scalar(node: yaml.Node) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        return _Composite(node)
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def _error(source: str, node: yaml.Node, message: str) -> KeysFileError:
    return KeysFileError(f"{source} line {node.start_mark.line + 1}: {message}")
