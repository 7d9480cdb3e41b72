"""Router layer (extra `[router]`): the prefix index in Redis, written by one router, readable
by any number.

Layout under a namespace `ns` (one Redis database, not a cluster: the scripts touch keys they
derive):
- `ns:h:<hash>`: a Redis hash, field `<instance>|<medium>|<group>` -> copies cached;
- `ns:i:<instance>`: a set of `<hash>|<medium>|<group>`, what the instance holds;
- `ns:epoch`: the fencing token of the current writer.
`<hash>` is the decimal int (64-bit hashes) or `x` + hex (digests); a None medium or group is
written as the empty string.

Every write and every score is one Lua script that first checks `ns:epoch` against the token
this index holds, so a write sent before an outage (delivered late, after a stall) or by an
earlier writer cannot land once `claim()` moved the epoch, and a database that restarted empty
or was flushed is noticed (`IndexLostError`) instead of answering from nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.router.index import (
    CacheKey,
    IndexLostError,
    IndexUnavailableError,
    check_instance_id,
    idempotent_set,
)

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"The Redis index needs redis-py: {install_hint('router')}"
    ) from exc

_FENCED = "PAGEDKV_FENCED"

# KEYS: epoch, instance set. ARGV: epoch token, namespace, instance, idempotent ("1"/"0"), then
# ops: "C" (clear the instance) or "S"/"R" (store/remove), where, n, then n hash tokens.
# Returns the number of removals of copies the index did not hold.
_APPLY = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('PAGEDKV_FENCED') end
local ns, inst, idempotent = ARGV[2], ARGV[3], ARGV[4] == '1'
local unknown = 0
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    for _, member in ipairs(redis.call('SMEMBERS', KEYS[2])) do
      local token, rest = string.match(member, '^([^|]*)|(.*)$')
      redis.call('HDEL', ns .. ':h:' .. token, inst .. '|' .. rest)
    end
    redis.call('DEL', KEYS[2])
    i = i + 1
  else
    local where, n = ARGV[i + 1], tonumber(ARGV[i + 2])
    local field = inst .. '|' .. where
    for j = i + 3, i + 2 + n do
      local token = ARGV[j]
      local key = ns .. ':h:' .. token
      if op == 'S' then
        local added
        if idempotent then
          added = redis.call('HSETNX', key, field, 1) == 1
        else
          added = redis.call('HINCRBY', key, field, 1) == 1
        end
        if added then redis.call('SADD', KEYS[2], token .. '|' .. where) end
      else
        local count = redis.call('HINCRBY', key, field, -1)
        if count <= 0 then
          redis.call('HDEL', key, field)
          redis.call('SREM', KEYS[2], token .. '|' .. where)
          if count < 0 then unknown = unknown + 1 end
        end
      end
    end
    i = i + 3 + n
  end
end
return unknown
"""

# KEYS: epoch, then one hash key per block. ARGV: epoch token, number of instances, the
# instance ids, then "1" and the accepted media ("" for None) to filter, or nothing.
# Returns each instance's count of leading blocks it caches.
_MATCH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return redis.error_reply('PAGEDKV_FENCED') end
local n = tonumber(ARGV[2])
local alive, lengths, num_alive = {}, {}, n
for j = 1, n do alive[ARGV[2 + j]] = j; lengths[j] = 0 end
local media = nil
if ARGV[3 + n] == '1' then
  media = {}
  for j = 4 + n, #ARGV do media[ARGV[j]] = true end
end
for k = 2, #KEYS do
  local here = {}
  for _, field in ipairs(redis.call('HKEYS', KEYS[k])) do
    local inst, medium = string.match(field, '^([^|]*)|([^|]*)|')
    if media == nil or media[medium] then here[inst] = true end
  end
  for id, j in pairs(alive) do
    if here[id] then lengths[j] = k - 1 else alive[id] = nil; num_alive = num_alive - 1 end
  end
  if num_alive == 0 then break end
end
return lengths
"""

_MAX_TOKENS_PER_SCRIPT = 4096


def _hash_token(block_hash: Hashable) -> str:
    if type(block_hash) is int:
        return str(block_hash)
    if type(block_hash) is bytes:
        return "x" + block_hash.hex()
    raise InvalidArgumentError(f"block hash must be an int or bytes, got {block_hash!r}")


def _parse_token(token: str) -> int | bytes:
    return bytes.fromhex(token[1:]) if token.startswith("x") else int(token)


def _where(medium: str | None, group_idx: int | None) -> str:
    if medium is not None and "|" in medium:
        raise InvalidArgumentError(f"medium {medium!r} contains '|', which the layout reserves")
    return f"{medium or ''}|{'' if group_idx is None else group_idx}"


class RedisPrefixIndex:
    """`PrefixIndex` stored in Redis. Every Redis failure surfaces as `IndexUnavailableError`
    (`IndexLostError` when the epoch moved: the database restarted empty, was flushed, or
    another writer claimed it).

    One writer per namespace: `claim()` moves the epoch, which fences every earlier writer
    (their writes fail with `IndexLostError`). The first write claims the namespace if no
    writer ever did; the `Router` claims it on start and after every outage.

    Args:
        client: a `redis.Redis`; by default one for `url` with short timeouts and no retries,
            so an outage is noticed in `socket_timeout_s` and the router can fall back.
        idempotent_stores: see `PrefixIndex` (True for all instances, or a set of ids).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "pagedkv",
        client: Any = None,
        socket_timeout_s: float = 0.5,
        idempotent_stores: bool | Collection[str] = False,
    ) -> None:
        if not namespace or "|" in namespace:
            raise InvalidArgumentError(f"namespace must be non-empty without '|': {namespace!r}")
        self.namespace = namespace
        self.client = client or redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        self._apply = self.client.register_script(_APPLY)
        self._match = self.client.register_script(_MATCH)
        self._idempotent = idempotent_set(idempotent_stores)
        self._epoch_key = f"{namespace}:epoch"
        self._epoch: str | None = None
        self.num_unknown_removals = 0

    def _hash_key(self, token: str) -> str:
        return f"{self.namespace}:h:{token}"

    def _instance_key(self, instance_id: str) -> str:
        return f"{self.namespace}:i:{instance_id}"

    @property
    def idempotent_stores(self) -> frozenset[str] | bool:
        return self._idempotent

    def is_idempotent(self, instance_id: str) -> bool:
        idempotent = self._idempotent
        return idempotent if isinstance(idempotent, bool) else instance_id in idempotent

    def claim(self) -> None:
        try:
            self._epoch = str(self.client.incr(self._epoch_key))
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc

    def _current_epoch(self) -> str:
        if self._epoch is None:
            try:
                epoch = self.client.get(self._epoch_key)
            except redis.RedisError as exc:
                raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
            if epoch is None:
                self.claim()
            else:
                self._epoch = str(epoch)
        assert self._epoch is not None
        return self._epoch

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        check_instance_id(instance_id)
        scripts: list[list[str]] = []
        ops: list[str] = []
        num_tokens = 0
        stream: Iterable[Any] = events  # narrowed by `type(...) is`, which mypy cannot follow
        for event in stream:
            kind = type(event)
            if kind is BlockStored or kind is BlockRemoved:
                tokens = [_hash_token(h) for h in event.block_hashes]
                if not tokens:
                    continue
                ops += ("S" if kind is BlockStored else "R", _where(event.medium,
                        event.group_idx), str(len(tokens)), *tokens)  # fmt: skip
                num_tokens += len(tokens)
            elif kind is AllBlocksCleared:
                ops.append("C")
            if num_tokens >= _MAX_TOKENS_PER_SCRIPT:
                scripts.append(ops)
                ops, num_tokens = [], 0
        if ops:
            scripts.append(ops)
        if not scripts:
            return
        epoch = self._current_epoch()
        head = [epoch, self.namespace, instance_id, "1" if self.is_idempotent(instance_id) else "0"]
        keys = [self._epoch_key, self._instance_key(instance_id)]
        pipe = self.client.pipeline(transaction=False)
        for script_ops in scripts:
            self._apply(keys=keys, args=head + script_ops, client=pipe)
        results = self._execute(pipe)
        self.num_unknown_removals += sum(int(r) for r in results)

    def clear_instance(self, instance_id: str) -> None:
        self.apply_events(instance_id, [AllBlocksCleared()])

    def match_lengths(
        self,
        block_hashes: Sequence[Hashable],
        instance_ids: Iterable[str],
        media: Collection[str | None] | None = None,
    ) -> dict[str, int]:
        ids = list(instance_ids)
        if not block_hashes or not ids:
            return dict.fromkeys(ids, 0)
        keys = [self._epoch_key, *(self._hash_key(_hash_token(h)) for h in block_hashes)]
        args = [self._current_epoch(), str(len(ids)), *ids]
        if media is not None:
            args += ["1", *(medium or "" for medium in media)]
        try:
            lengths = self._match(keys=keys, args=args)
        except redis.RedisError as exc:
            raise self._error(exc) from exc
        return {instance_id: int(n) for instance_id, n in zip(ids, lengths, strict=True)}

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        check_instance_id(instance_id)
        try:
            members = sorted(self.client.smembers(self._instance_key(instance_id)))
            pipe = self.client.pipeline(transaction=False)
            for member in members:
                token, where = member.split("|", 1)
                pipe.hget(self._hash_key(token), f"{instance_id}|{where}")
            counts = pipe.execute()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
        out: dict[CacheKey, int] = {}
        for member, count in zip(members, counts, strict=True):
            token, medium, group = member.split("|")
            key = (medium or None, int(group) if group else None, _parse_token(token))
            out[key] = int(count)
        return out

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc

    def drop_namespace(self) -> int:
        """Delete every key of this namespace (tests, fresh deployments); returns the count."""
        try:
            keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
            if keys:
                self.client.delete(*keys)
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"Redis index unavailable: {exc}") from exc
        self._epoch = None
        return len(keys)

    def _error(self, exc: Exception) -> IndexUnavailableError:
        if isinstance(exc, redis.ResponseError) and _FENCED in str(exc):
            return IndexLostError(
                f"Redis index {self.namespace!r} lost: its epoch is no longer {self._epoch} "
                "(restarted empty, flushed, or claimed by another writer)"
            )
        return IndexUnavailableError(f"Redis index unavailable: {exc}")

    def _execute(self, pipe: Any) -> list:
        try:
            return pipe.execute()
        except redis.RedisError as exc:
            raise self._error(exc) from exc
