"""What a Serve config's `args:` block (or build_app's dict) may say, checked before anything starts.

Engine settings keep EngineConfig's flat names (vLLM's), so a Serve config reads like `raypaged launch`
flags with underscores; deployment settings (replicas, autoscaling, resources) sit beside them.
An unknown key is an error, not silently ignored: a typo in a YAML file must not go unnoticed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from raypaged.config import SERVING_MAX_WAITING_REQUESTS, ConfigError, EngineConfig
from raypaged.frontend.keys_file import KeysFileError, load_keys_file
from raypaged.frontend.prefix_router import ROUTING_POLICIES
from raypaged.frontend.tenants import TenantRegistry
from raypaged.frontend.validation import RequestLimits
from raypaged.text.chat_parsing import ChatParsing


@dataclass
class AutoscalingArgs:
    """Replicas scale on their queue: Serve's ongoing requests per replica (queued at the replica
    plus being generated), averaged over look_back_period_s, aimed at target_ongoing_requests."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 300.0
    look_back_period_s: float = 10.0

    def to_serve(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ServeAppArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    # None: the model directory's name ("demo" for the demo); several: the first is the model's
    # name, /v1/models lists them all and requests may name any (vLLM's --served-model-name).
    served_model_name: str | list[str] | None = None

    @property
    def served_model_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [])
    # The ingress deployment's name; the engine deployment's is this with "_engine" after it.
    deployment_name: str = "raypaged"
    num_replicas: int | None = 1  # engine replicas; None with autoscaling set
    autoscaling: AutoscalingArgs | None = None
    # Requests one replica accepts at once before Serve queues them at the proxy; must exceed
    # the autoscaling target or the target can never be reached.
    max_ongoing_requests: int = 256
    # How the ingress's handle picks an engine replica (frontend/prefix_router.py policies).
    routing_policy: str = "prefix"
    replica_num_cpus: float = 1.0  # an engine replica actor's own CPU
    # The ingress (serve/deployment.py): its replicas hold the clients' connections, the text
    # side and the API keys' limits (counted per ingress replica).
    ingress_num_replicas: int = 1
    ingress_num_cpus: float = 1.0
    # How long a stream whose engine replica died waits for another one to take it.
    replica_recovery_timeout_s: float = 60.0
    stats_interval_s: float = 1.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Chat answers' parsers, as vLLM's flags name them (serve/chat_tools.py).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # The API keys file (frontend/keys_file.py), read by every ingress replica: it must be at
    # this path on every node (a mounted secret). None: no authentication. Limits are per
    # ingress replica.
    api_keys_file: str | None = None

    @property
    def chat_parsing(self) -> ChatParsing:
        return ChatParsing(self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)

    def api_keys(self) -> TenantRegistry | None:
        if self.api_keys_file is None:
            return None
        try:
            return load_keys_file(self.api_keys_file)
        except KeysFileError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ServeAppArgs:
        raw = dict(raw or {})
        engine_names = EngineConfig.names()
        own_names = {f.name for f in dataclasses.fields(cls)} - {"engine", "autoscaling", "limits"}
        limit_names = {f.name for f in dataclasses.fields(RequestLimits)}
        engine_values = {k: raw.pop(k) for k in list(raw) if k in engine_names}
        engine_values.setdefault("max_waiting_requests", SERVING_MAX_WAITING_REQUESTS)
        own = {k: raw.pop(k) for k in list(raw) if k in own_names}
        autoscaling = raw.pop("autoscaling", None)
        limits = raw.pop("limits", None) or {}
        if raw:
            raise ConfigError(
                f"unknown raypaged.serve argument(s) {sorted(raw)}; known: engine settings "
                f"{sorted(engine_names)}, and {sorted(own_names | {'autoscaling', 'limits'})}")
        unknown_limits = set(limits) - limit_names
        if unknown_limits:
            raise ConfigError(f"unknown limits {sorted(unknown_limits)}; known: {sorted(limit_names)}")
        args = cls(engine=EngineConfig(**engine_values), limits=RequestLimits(**limits), **own)
        if autoscaling is not None:
            if not isinstance(autoscaling, dict):
                raise ConfigError(f"autoscaling must be a mapping, got {autoscaling!r}")
            known = {f.name for f in dataclasses.fields(AutoscalingArgs)}
            if set(autoscaling) - known:
                raise ConfigError(
                    f"unknown autoscaling setting(s) {sorted(set(autoscaling) - known)}; known: {sorted(known)}")
            args.autoscaling = AutoscalingArgs(**autoscaling)
            args.num_replicas = None
        args.validate()
        return args

    def validate(self) -> None:
        self.engine.validate()
        self.chat_parsing.validate()
        self.api_keys()  # a malformed file fails the deploy, not every replica's start
        checks = [
            (self.num_replicas is None or self.num_replicas >= 1, "num_replicas must be >= 1"),
            (self.max_ongoing_requests >= 1, "max_ongoing_requests must be >= 1"),
            (self.routing_policy in ROUTING_POLICIES, f"routing_policy must be one of {ROUTING_POLICIES}"),
            (self.engine.scheduler.prefix_caching_hash_algo == "sha256"
             or (self.num_replicas == 1 and self.autoscaling is None),
             "several replicas are routed by block hashes: prefix_caching_hash_algo must be sha256"),
            (self.replica_num_cpus >= 0, "replica_num_cpus must be >= 0"),
            (self.ingress_num_replicas >= 1, "ingress_num_replicas must be >= 1"),
            (self.ingress_num_cpus >= 0, "ingress_num_cpus must be >= 0"),
            (self.replica_recovery_timeout_s > 0, "replica_recovery_timeout_s must be > 0"),
            (self.stats_interval_s > 0, "stats_interval_s must be > 0"),
            (self.served_model_name is None or (bool(self.served_model_names) and all(
                isinstance(n, str) and n for n in self.served_model_names)),
             "served_model_name must be a name or a non-empty list of non-empty names"),
        ]
        scaling = self.autoscaling
        if scaling is not None:
            checks += [
                (0 <= scaling.min_replicas <= scaling.max_replicas and scaling.max_replicas >= 1,
                 f"autoscaling needs 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                 f"{scaling.min_replicas} and {scaling.max_replicas}"),
                (0 < scaling.target_ongoing_requests < self.max_ongoing_requests,
                 f"autoscaling.target_ongoing_requests must be in (0, max_ongoing_requests = "
                 f"{self.max_ongoing_requests}), got {scaling.target_ongoing_requests}"),
            ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
