"""Router layer (stdlib): the configuration of `pagedkv router serve`, from flags or a small TOML
file, checked before anything starts (a bad value is one `ConfigError` naming it)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.credentials import redact
from pagedkv.errors import ConfigError
from pagedkv.hashing import HASH_ALGORITHMS
from pagedkv.router.index import check_instance_id
from pagedkv.router.policies import ROUTING_POLICY_NAMES
from pagedkv.wire.endpoints import check_endpoint

INSTANCE_FORMATS = ("pagedkv", "vllm")
VLLM_HASH_ALGORITHM = "sha256_cbor"
"""The only algorithm whose vLLM hashes we can recompute from token ids (vLLM's default sha256
hashes a pickle)."""


@dataclass(frozen=True)
class InstanceConfig:
    """One engine instance: where its KV events are published.

    `format="vllm"` (a vLLM engine with `--kv-events-config`): stores are idempotent by
    default, since requests with `kv_cache_report_mode="full"` re-send `BlockStored` for prefix
    hits (see `PrefixIndex`), and vLLM answers no snapshot request.
    """

    instance_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    format: str = "pagedkv"
    idempotent_stores: bool | None = None
    """None: True for vLLM instances, False for pagedkv ones."""
    health_url: str | None = None
    """Optional: the engine's health endpoint (vLLM: http://HOST:PORT/health); while it fails
    the instance is down (not scored, not routed to)."""

    def __post_init__(self) -> None:
        try:
            check_instance_id(self.instance_id)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name, endpoint in (("endpoint", self.endpoint), ("replay", self.replay_endpoint)):
            if endpoint is not None:
                try:
                    check_endpoint(endpoint)
                except ValueError as exc:
                    raise ConfigError(f"instance {self.instance_id}: {name} {exc}") from exc
        if self.health_url is not None and not (
            isinstance(self.health_url, str) and self.health_url.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"instance {self.instance_id}: health_url must be http(s)://..., got "
                f"{self.health_url!r}"
            )
        if self.format not in INSTANCE_FORMATS:
            raise ConfigError(
                f"instance {self.instance_id}: format must be one of {INSTANCE_FORMATS}, got "
                f"{self.format!r}"
            )

    @property
    def idempotent(self) -> bool:
        if self.idempotent_stores is None:
            return self.format == "vllm"
        return self.idempotent_stores


@dataclass(frozen=True)
class ServiceConfig:
    instances: tuple[InstanceConfig, ...]
    block_size: int = 16
    hash_algorithm: str = "sha256"
    index: str = "memory"
    """"memory" or redis://HOST:PORT[/DB]."""
    policy: str = "prefix-aware"
    max_load_gap: float | None = 4.0
    host: str = "127.0.0.1"
    port: int = 8000
    retry_interval_s: float = 1.0
    replay_timeout_s: float = 1.0
    """Replay progress deadline: the wait for the first batch of an answer and between two."""
    stale_after_s: float = 3.0
    """An instance whose stream carries no batch and no heartbeat for this long is down; also
    how long `/ready` waits for an instance that never connected."""
    grace_s: float = 30.0
    """How long a down instance's entries are kept for its stream to resume."""
    seed: int = 0
    """Seeds the random tie-break between equally good, equally loaded instances."""
    tie_break: str = "random"
    """"random" (seeded by `seed`: equal instances share the traffic) or "first" (the first
    listed, as `pagedkv simulate`'s in-process router breaks ties, so a run through the
    service can be compared with one in process)."""
    tokenizer: str | None = None
    """A local tokenizer directory (transformers), so requests may send text."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.instances:
            raise ConfigError("no instance: give --instance ID=ENDPOINT (or a config file)")
        ids = [i.instance_id for i in self.instances]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"instance ids must be unique, got {ids}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                f"hash_algorithm must be one of {sorted(HASH_ALGORITHMS)}, got "
                f"{self.hash_algorithm!r}"
            )
        vllm = [i.instance_id for i in self.instances if i.format == "vllm"]
        if vllm and self.hash_algorithm != VLLM_HASH_ALGORITHM:
            raise ConfigError(
                f"vLLM instances {vllm}: score them with --hash-algorithm {VLLM_HASH_ALGORITHM} "
                f"and start vLLM with --prefix-caching-hash-algo {VLLM_HASH_ALGORITHM} (its "
                "default sha256 hashes a pickle, which no other process can recompute)"
            )
        if self.index != "memory" and not self.index.startswith(("redis://", "rediss://")):
            raise ConfigError(
                f"index must be 'memory' or redis://HOST:PORT, got {redact(repr(self.index))}"
            )
        if self.policy not in ROUTING_POLICY_NAMES:
            raise ConfigError(f"policy must be one of {ROUTING_POLICY_NAMES}, got {self.policy!r}")
        if self.max_load_gap is not None and not self.max_load_gap >= 0:
            raise ConfigError(f"max_load_gap must be >= 0 or none, got {self.max_load_gap!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not self.retry_interval_s >= 0 or not self.replay_timeout_s > 0:
            raise ConfigError("retry_interval_s must be >= 0 and replay_timeout_s > 0")
        for name in ("stale_after_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.tie_break not in ("random", "first"):
            raise ConfigError(f"tie_break must be 'random' or 'first', got {self.tie_break!r}")


def parse_instance(spec: str, instance_format: str = "pagedkv") -> InstanceConfig:
    """`ID=ENDPOINT[,REPLAY_ENDPOINT[,HEALTH_URL]]` from the command line."""
    instance_id, sep, endpoints = spec.partition("=")
    parts = endpoints.split(",")
    if not sep or not endpoints or len(parts) > 3:
        raise ConfigError(
            f"--instance takes ID=ENDPOINT[,REPLAY_ENDPOINT[,HEALTH_URL]], got {spec!r}"
        )
    endpoint, replay, health = [*parts, "", ""][:3]
    return InstanceConfig(
        instance_id, endpoint, replay or None, format=instance_format, health_url=health or None
    )


_FILE_KEYS = {
    "block_size",
    "hash_algorithm",
    "index",
    "policy",
    "max_load_gap",
    "host",
    "port",
    "retry_interval_s",
    "replay_timeout_s",
    "stale_after_s",
    "grace_s",
    "seed",
    "tie_break",
    "tokenizer",
    "instances",
}
_INSTANCE_KEYS = {
    "id",
    "endpoint",
    "replay_endpoint",
    "topic",
    "format",
    "idempotent_stores",
    "health_url",
}


def load_config_file(path: str | Path, overrides: dict[str, Any]) -> ServiceConfig:
    """Read a TOML config (top-level settings and `[[instances]]` tables); `overrides` (the
    flags given) win over the file."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc}") from exc
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: unknown settings {sorted(unknown)}; known: {sorted(_FILE_KEYS)}"
        )
    instances = []
    for number, item in enumerate(data.pop("instances", []), 1):
        if not isinstance(item, dict) or set(item) - _INSTANCE_KEYS or "id" not in item:
            raise ConfigError(
                f"{path}: instance {number} must be a table with id, endpoint and optionally "
                f"{sorted(_INSTANCE_KEYS - {'id', 'endpoint'})}, got {item!r}"
            )
        instances.append(
            InstanceConfig(
                instance_id=item["id"],
                endpoint=item.get("endpoint", ""),
                replay_endpoint=item.get("replay_endpoint"),
                topic=item.get("topic", ""),
                format=item.get("format", "pagedkv"),
                idempotent_stores=item.get("idempotent_stores"),
                health_url=item.get("health_url"),
            )
        )
    settings = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    if "instances" in settings:
        instances = [*instances, *settings.pop("instances")]
    try:
        return ServiceConfig(instances=tuple(instances), **settings)
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
