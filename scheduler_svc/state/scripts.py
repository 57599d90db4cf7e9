"""The server-side (Lua) scripts of the request store (scheduler_svc/state/store.py).

Each script that writes request state first checks the writer's leader epoch when leader
election is on (scheduler_svc/state/leader.py): a scheduler that lost the lease gets a
`FENCED` error and nothing is written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ABORT_AHEAD_LUA", "APPEND_LUA", "BATCH_LUA", "CREATE_LUA", "FencedBatch"]

# One call per engine step for every sequence's new tokens. KEYS[1] and ARGV[1]: the leader
# epoch key and the writer's epoch ("0": no leader election; otherwise the write is refused
# unless that epoch is the current one, see scheduler_svc/state/leader.py). Then KEYS per
# append: the tokens list, then the logprobs list when the append has logprobs. ARGV per
# append: offset, count, has_logprobs, tokens..., [logprob json...]. Returns one value per append: the stored length
# afterwards, or -1 when the stored list was shorter than `offset` (a gap: Redis lost data and
# the caller must resynchronise; nothing is written then).
#
# The common case costs one RPUSH: the tokens are pushed first and the reply (the new length)
# shows whether they were all new. If the list already held some of them (a write retried after
# a lost reply), the duplicates are trimmed off again; if it held fewer than `offset`, the push
# is undone. Either way the stored list ends exactly as if every token had been written once.
APPEND_LUA = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED leadership epoch ' .. ARGV[1] .. ' is not the current one')
end
local out = {}
local a = 2
local k = 2
while k <= #KEYS do
  local offset = tonumber(ARGV[a])
  local count = tonumber(ARGV[a + 1])
  local with_lp = ARGV[a + 2] == '1'
  local first = a + 3
  local key = KEYS[k]
  local had = redis.call('RPUSH', key, unpack(ARGV, first, first + count - 1)) - count
  local result = offset + count
  if had ~= offset then
    if had == 0 then redis.call('DEL', key) else redis.call('LTRIM', key, 0, had - 1) end
    if had < offset then
      result = -1
    else
      for i = had - offset + 1, count do redis.call('RPUSH', key, ARGV[first + i - 1]) end
      result = math.max(had, offset + count)
    end
  end
  if with_lp then
    if result ~= -1 then
      local lp_key = KEYS[k + 1]
      for i = math.max(1, redis.call('LLEN', lp_key) - offset + 1), count do
        redis.call('RPUSH', lp_key, ARGV[first + count + i - 1])
      end
    end
    k = k + 2
  else
    k = k + 1
  end
  out[#out + 1] = result
  a = first + count * (with_lp and 2 or 1)
end
return out
"""

# KEYS: request hash, unfinished set, leader epoch, abort tombstone. ARGV: epoch, req_id,
# honour_abort ("1"/"0"), finished TTL in ms, finish reasons of an aborted request (JSON),
# then field, value, ... Claims the id atomically: 0 when it exists already, 1 when created.
# An abort that came first (its tombstone, ABORT_AHEAD_LUA) wins: the request is stored
# already finished as aborted, never listed as unfinished, and 2 is returned. Checking the
# tombstone in the same script as the claim is what makes the race impossible: Redis runs
# this and ABORT_AHEAD_LUA one after the other, so each sees the other's write or none of it.
CREATE_LUA = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[3]) ~= ARGV[1] then
  return redis.error_reply('FENCED leadership epoch ' .. ARGV[1] .. ' is not the current one')
end
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if ARGV[3] == '1' and redis.call('DEL', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[1], 'status', 'finished', 'finish_reasons', ARGV[5])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return 2
end
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""

# An abort of an id this scheduler does not hold. KEYS: request hash, abort tombstone, leader
# epoch. ARGV: epoch, tombstone TTL in ms. Returns the stored request's status ("active" or
# "finished") when it exists; otherwise leaves the tombstone that CREATE_LUA honours and
# returns "tombstoned".
ABORT_AHEAD_LUA = """
if ARGV[1] ~= '0' and redis.call('GET', KEYS[3]) ~= ARGV[1] then
  return redis.error_reply('FENCED leadership epoch ' .. ARGV[1] .. ' is not the current one')
end
local status = redis.call('HGET', KEYS[1], 'status')
if status then return status end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 'tombstoned'
"""

# Any other writes under leader election, fenced as one script call. KEYS[1]: leader epoch.
# ARGV: epoch, then each command as its argument count followed by its arguments.
BATCH_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED leadership epoch ' .. ARGV[1] .. ' is not the current one')
end
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return 1
"""


class FencedBatch:
    """Records the write commands the store queues (the pipeline methods it uses) as the
    flat argument list of BATCH_LUA."""

    def __init__(self) -> None:
        self.args: list[Any] = []

    def _add(self, *cmd: Any) -> None:
        self.args.append(len(cmd))
        self.args.extend(cmd)

    def hset(
        self, key: str, field: str | None = None, value: Any = None, mapping: dict | None = None
    ) -> None:
        pairs = [] if field is None else [field, value]
        for k, v in (mapping or {}).items():
            pairs.extend((k, v))
        self._add("HSET", key, *pairs)

    def srem(self, key: str, *members: Any) -> None:
        self._add("SREM", key, *members)

    def pexpire(self, key: str, ms: int) -> None:
        self._add("PEXPIRE", key, ms)

    def delete(self, *keys: str) -> None:
        self._add("DEL", *keys)

    def rpush(self, key: str, *values: Any) -> None:
        self._add("RPUSH", key, *values)
