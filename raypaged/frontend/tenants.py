"""Tenants: who a request comes from (its API key), and what that changes for it.

A `TenantRegistry` maps each API key to a `Tenant`: a name (metric label, log name), limits
(frontend/rate_limit.py enforces them at the door) and a priority. The registry is the one
authentication model of both front doors: a single bearer token (`--auth-token`) is a registry
of one tenant, "default", without limits; a keys file (frontend/keys_file.py) adds one tenant
per key.

What a tenant changes for its requests (applied by frontend/tenant_door.py):

- Prefix cache: every request's cache salt starts with its tenant's name, so blocks hashed for
  one tenant are never a hit for another. A client's own `cache_salt` divides its tenant's
  cache further and cannot reach into another tenant's: names cannot hold the separator, so
  (name, client salt) is read back from the salt one way only.
- Priority (lower is earlier, as vLLM's): the key's priority is where its requests go by
  default and the earliest they may ask for; a request may ask for a later place (a larger
  number). The proto's 0 means "not set": it takes the key's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "Bearer "
# A tenant name: a metric label value and part of every cache salt of its requests.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SALT_PREFIX = "tenant:"
SALT_SEPARATOR = "\x1f"  # never in a name (NAME_PATTERN): the salt parses back one way only
DEFAULT_TENANT = "default"  # the single --auth-token's tenant


def check_key(key: str, what: str = "an API key") -> str:
    """The key, refused when it could not safely travel in a header or is too weak."""
    if len(key) < 16:
        raise ValueError(f"{what} must have at least 16 characters")
    if not key.isascii() or not key.isprintable() or " " in key:
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return key


@dataclass(frozen=True)
class TenantLimits:
    """None: no limit of that kind. burst: the requests a key may send at once before
    requests_per_second paces it (None: requests_per_second rounded up, at least 1)."""

    requests_per_second: float | None = None
    burst: int | None = None
    tokens_per_minute: int | None = None  # prompt and generated tokens
    max_concurrent: int | None = None  # requests in flight at once (n > 1 counts once)

    @property
    def request_burst(self) -> int:
        if self.burst is not None:
            return self.burst
        rate = self.requests_per_second or 1.0
        return max(1, -int(-rate // 1))

    @property
    def unlimited(self) -> bool:
        return (self.requests_per_second, self.tokens_per_minute, self.max_concurrent) == (None, None, None)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)
    priority: int = 0

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.name):
            raise ValueError(f"a tenant name must match {NAME_PATTERN.pattern}, got {self.name!r}")

    def cache_salt(self, client_salt: str | None) -> str:
        """The salt a request of this tenant is cached under (see the module's docstring)."""
        own = SALT_PREFIX + self.name
        return own + SALT_SEPARATOR + client_salt if client_salt else own

    def priority_for(self, requested: int) -> int:
        """The priority a request asking for `requested` is scheduled at."""
        return self.priority if requested == 0 else max(self.priority, requested)


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class TenantRegistry:
    """API keys → tenants. Keys are held and looked up by their SHA-256 only: a lookup's timing
    says nothing about a key, and the keys themselves are not kept."""

    def __init__(self, tenants: Mapping[str, Tenant]) -> None:
        """tenants: API key → its tenant; keys and names must be unique."""
        self._by_digest: dict[bytes, Tenant] = {}
        names: set[str] = set()
        for key, tenant in tenants.items():
            check_key(key)
            if tenant.name in names:
                raise ValueError(f"two API keys name the tenant {tenant.name!r}; names must be unique")
            names.add(tenant.name)
            self._by_digest[_digest(key)] = tenant

    @classmethod
    def single(cls, token: str) -> TenantRegistry:
        """The registry of one bearer token (--auth-token): the tenant "default", no limits."""
        return cls({token: Tenant(DEFAULT_TENANT)})

    @classmethod
    def merge(cls, registries: Iterable[TenantRegistry | None]) -> TenantRegistry | None:
        """One registry of every key of these (None when there are none); a key or a tenant
        name in two of them is a ValueError."""
        merged: TenantRegistry | None = None
        for registry in registries:
            if registry is None:
                continue
            if merged is None:
                merged = cls({})
            for digest, tenant in registry._by_digest.items():
                if digest in merged._by_digest:
                    raise ValueError(f"the API key of tenant {tenant.name!r} is given twice")
                if tenant.name in {t.name for t in merged.tenants}:
                    raise ValueError(f"two API keys name the tenant {tenant.name!r}; names must be unique")
                merged._by_digest[digest] = tenant
        return merged

    @property
    def tenants(self) -> list[Tenant]:
        return sorted(self._by_digest.values(), key=lambda t: t.name)

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def uses_priorities(self) -> bool:
        return any(t.priority != 0 for t in self._by_digest.values())

    def lookup(self, key: str | bytes) -> Tenant | None:
        return self._by_digest.get(_digest(key))

    def authenticate(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <key>` value; None for anything else."""
        if authorization is None:
            return None
        value = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        prefix = BEARER.encode()
        if not value.startswith(prefix):
            return None
        return self.lookup(value[len(prefix):])

    def from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """The tenant of gRPC call metadata: exactly one `authorization` entry, a known key."""
        values = [value for key, value in (metadata or ()) if key == AUTHORIZATION_KEY]
        return self.authenticate(values[0]) if len(values) == 1 else None


def unused_priorities_warning(registry: TenantRegistry | None, scheduling_policy: str) -> str | None:
    """What to warn about when keys give priorities that the scheduling policy ignores."""
    if registry is None or not registry.uses_priorities or scheduling_policy == "priority":
        return None
    return (f"the API keys give priorities, but the scheduling policy is {scheduling_policy!r}: "
            "they order nothing (--scheduling-policy priority)")
