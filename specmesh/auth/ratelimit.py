"""Per-key token buckets in Redis: requests/minute and tokens/minute, one atomic Lua script each.

Each limit L is a bucket of capacity L refilled at L/60 per second, on Redis's own clock (TIME),
so any number of gateway replicas sharing one Redis agree. `reserve` checks both buckets and
takes from both or from neither (tokens = prompt + max_tokens); `refund` gives back the part
of a reservation that was not generated. A request that can never fit (cost > tpm) is refused
with no retry hint. Both bucket keys share a hash tag, so the script also runs on Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

_LEVEL = """
local function level(key, limit, now)
  local b = redis.call('HMGET', key, 'level', 'ts')
  local lv, ts = tonumber(b[1]), tonumber(b[2])
  if lv == nil or ts == nil then return limit end
  return math.min(limit, lv + math.max(0, now - ts) * limit / 60.0)
end
local function store(key, lv, now)
  redis.call('HSET', key, 'level', tostring(lv), 'ts', tostring(now))
  redis.call('EXPIRE', key, 120)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

RESERVE = _LEVEL + """
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and cost > tpm then return {-1, '0', 'tokens'} end
local r, k = 0, 0
local wait_r, wait_t = 0, 0
if rpm > 0 then
  r = level(KEYS[1], rpm, now)
  if r < 1 then wait_r = (1 - r) * 60.0 / rpm end
end
if tpm > 0 then
  k = level(KEYS[2], tpm, now)
  if k < cost then wait_t = (cost - k) * 60.0 / tpm end
end
if wait_r > 0 or wait_t > 0 then
  if wait_r >= wait_t then return {0, tostring(wait_r), 'requests'} end
  return {0, tostring(wait_t), 'tokens'}
end
if rpm > 0 then store(KEYS[1], r - 1, now) end
if tpm > 0 then store(KEYS[2], k - cost, now) end
return {1, '0', ''}
"""

REFUND = _LEVEL + """
local tpm, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm <= 0 or amount <= 0 then return '0' end
local k = math.min(tpm, level(KEYS[1], tpm, now) + amount)
store(KEYS[1], k, now)
return tostring(k)
"""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float | None = None  # None with allowed=False: can never fit
    limit: str = ""  # "requests" | "tokens": the limit that refused


class RateLimiter:
    """Raises redis.RedisError when Redis is unreachable (the caller decides open / closed)."""

    def __init__(self, client, prefix: str = "specmesh"):
        self.r = client
        self.prefix = prefix
        self._reserve = client.register_script(RESERVE)
        self._refund = client.register_script(REFUND)

    def _keys(self, key_hash: str) -> list[str]:
        tag = "{" + key_hash + "}"
        return [f"{self.prefix}:rl:{tag}:req", f"{self.prefix}:rl:{tag}:tok"]

    def reserve(self, key_hash: str, rpm: int, tpm: int, tokens: int) -> Decision:
        if rpm <= 0 and tpm <= 0:
            return Decision(True)
        code, wait, limit = self._reserve(keys=self._keys(key_hash), args=[rpm, tpm, tokens])
        code = int(code)
        if code == 1:
            return Decision(True)
        return Decision(False, None if code < 0 else float(wait), str(limit))

    def refund(self, key_hash: str, tpm: int, tokens: int) -> None:
        if tpm > 0 and tokens > 0:
            self._refund(keys=self._keys(key_hash)[1:], args=[tpm, tokens])

    def levels(self, key_hash: str) -> dict:
        """Stored bucket levels (for tests and `keys list --usage`), without refill applied."""
        out = {}
        for name, k in zip(("requests", "tokens"), self._keys(key_hash)):
            lv = self.r.hget(k, "level")
            out[name] = None if lv is None else float(lv)
        return out
