"""The Lua scripts of the Redis store: each change to the journal or a run, atomically.

Key layout and conventions: see the package docstring. Scripts get the key prefix as an
argument where they reach keys they learn from the data (a run's journal, its index
entries): on Redis Cluster every key shares the prefix's hash tag, so they are all in the
slot of the keys the script names (:mod:`.cluster`). Absent hash fields stand
for None. Times are UNIX seconds as decimal strings; expiries are milliseconds. Constants
shared with the other stores (run states, the history's length) are written into the
script text from :mod:`..base`, so they are defined once.
"""

from ..model import ENDED, RUN_STATES
from ..rules import HISTORY_LIMIT
from ..waking import RUN_LOST

ENTRY_FIELDS = ("kid", "tenant", "run", "epoch", "upstream", "key", "fingerprint", "state", "owner",
                "lease_until", "created_at", "completed_at", "expires_at", "replays", "detail",
                "method", "path", "namespace")  # an Entry's hash fields, besides its response
# What a read returns, in this order: a list of values parses faster than a hash's pairs.
READ_FIELDS = (*ENTRY_FIELDS, "status", "headers", "body", "streamed", "timing", "evidence")

# -- the journal --------------------------------------------------------------------------

CLAIM = """
-- KEYS: entry, partial, run, steps, steps-expiry, quarantined. Returns {'won'}, {'stale', epoch} or
-- {'taken', the entry's READ_FIELDS}
-- ARGV: now, epoch ('' = unfenced), fingerprint, owner, on_expired, expires_ms, kid, index member,
--       the new entry's fields (a JSON object of strings: one argument packs faster than forty)
if ARGV[2] ~= '' then  -- a superseded attempt must not claim (checked here, atomically)
  local epoch = redis.call('HGET', KEYS[3], 'epoch')
  if epoch and tonumber(epoch) > tonumber(ARGV[2]) then return {'stale', epoch} end
end
local e = redis.call('HMGET', KEYS[1], 'state', 'lease_until', 'fingerprint', 'owner')
if e[1] and e[1] ~= 'retried' then  -- an entry an operator retried is taken over: the call goes upstream
  -- this very claim, sent again after its reply was lost: it is ours
  if e[1] == 'in_flight' and e[4] == ARGV[4] then return {'won'} end
  if e[1] ~= 'in_flight' or tonumber(e[2]) > tonumber(ARGV[1]) or e[3] ~= ARGV[3] then
    -- whole, with any response: the caller may replay it at once
    return {'taken', redis.call('HMGET', KEYS[1], READ_FIELDS)}
  end
  if ARGV[5] == 'quarantine' then  -- its proxy died mid-call: the outcome is unknown
    redis.call('HSET', KEYS[1], 'state', 'unknown', 'detail', 'the proxy holding the claim stopped mid-call')
    redis.call('HDEL', KEYS[1], 'owner')
    redis.call('DEL', KEYS[2])
    redis.call('ZADD', KEYS[6], math.floor(tonumber(redis.call('HGET', KEYS[1], 'expires_at')) * 1000), ARGV[7])
    return {'taken', redis.call('HMGET', KEYS[1], READ_FIELDS)}
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
local fields = {}
for name, value in pairs(cjson.decode(ARGV[9])) do
  fields[#fields + 1] = name
  fields[#fields + 1] = value
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIREAT', KEYS[1], ARGV[6])
if ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[4], ARGV[1], ARGV[7])
  redis.call('ZADD', KEYS[5], ARGV[6], ARGV[8])
end
return {'won'}
"""

# KEYS: entry. The entry's READ_FIELDS: a script, because a command naming the 23 fields
# costs the proxy more to pack than the whole read costs the server.
READ = """return redis.call('HMGET', KEYS[1], READ_FIELDS)"""

RECORDED = """
-- KEYS: steps; ARGV: prefix, now, max_bytes. Returns {all (1 or 0), {READ_FIELDS of each
-- complete, unexpired entry, oldest first, while their bodies fit in max_bytes}}
local out, total = {}, 0
for _, kid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local key = ARGV[1] .. 'entry:' .. kid
  local e = redis.call('HMGET', key, 'state', 'expires_at')
  if e[1] == 'complete' and tonumber(e[2]) > tonumber(ARGV[2]) then
    total = total + redis.call('HSTRLEN', key, 'body')
    if total > tonumber(ARGV[3]) then return {0, out} end
    out[#out + 1] = redis.call('HMGET', key, READ_FIELDS)
  end
end
return {1, out}
"""

CLAIM, READ, RECORDED = (script.replace("READ_FIELDS", ", ".join(f"'{name}'" for name in READ_FIELDS))
                         for script in (CLAIM, READ, RECORDED))

REPLAY_OCCURRENCE = """
-- KEYS: run, occ; ARGV: epoch, "{epoch}:{fingerprint}", retention (ms). Returns the
-- occurrence (from 0), or false, counting nothing, unless the run is at that epoch
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch or tonumber(epoch) ~= tonumber(ARGV[1]) then return false end
local n = redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return n - 1
"""

RENEW = """
-- KEYS: entry; ARGV: owner, lease_until
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[1], 'state') ~= 'in_flight' then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', ARGV[2])
return 1
"""

COMPLETE = """
-- KEYS: entry, partial; ARGV: owner, channel, kid, then the response's fields
local e = redis.call('HMGET', KEYS[1], 'owner', 'state')
local done = 0
if e[1] == ARGV[1] and e[2] == 'in_flight' then
  redis.call('HSET', KEYS[1], unpack(ARGV, 4))
  redis.call('HDEL', KEYS[1], 'owner')
  redis.call('DEL', KEYS[2])
  done = 1
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return done
"""

RELEASE = """
-- KEYS: entry, partial, steps-expiry; ARGV: owner, channel, kid, prefix
local e = redis.call('HMGET', KEYS[1], 'owner', 'rk', 'key', 'epoch', 'fingerprint', 'tenant')
if e[1] == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  if e[2] then
    redis.call('ZREM', ARGV[4] .. 'steps:' .. e[2], ARGV[3])
    redis.call('ZREM', KEYS[3], ARGV[3] .. ' ' .. e[2])
    local n = string.match(e[3], '^derived:.*:(%d+)$')
    if n then  -- give the occurrence number back, so the caller's retry maps onto this slot
      -- counted per tenant: the field is "{epoch}:" .. base.counted(tenant, fingerprint)
      local occ, field = ARGV[4] .. 'occ:' .. e[2], (e[4] or '-1') .. ':' .. e[6] .. ' ' .. e[5]
      if tonumber(redis.call('HGET', occ, field)) == tonumber(n) + 1 then
        redis.call('HINCRBY', occ, field, -1)
      end
    end
  end
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
"""

SET_STATE = """
-- KEYS: entry, partial, quarantined; ARGV: owner ('' = whoever holds it), state, detail,
-- channel, kid, evidence (JSON, or '')
local owner = redis.call('HGET', KEYS[1], 'owner')
if redis.call('EXISTS', KEYS[1]) == 1 and (ARGV[1] == '' or owner == ARGV[1]) then
  redis.call('HSET', KEYS[1], 'state', ARGV[2], 'detail', ARGV[3])
  redis.call('HDEL', KEYS[1], 'owner')
  redis.call('DEL', KEYS[2])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'evidence', ARGV[6]) end
  if ARGV[2] == 'unknown' then  -- counted until resolved or expired (its score)
    redis.call('ZADD', KEYS[3], math.floor(tonumber(redis.call('HGET', KEYS[1], 'expires_at')) * 1000), ARGV[5])
  end
end
redis.call('PUBLISH', ARGV[4], ARGV[5])
"""

RESOLVE = """
-- KEYS: entry, steps-expiry, quarantined; ARGV: channel, kid, prefix, then the answer's
-- fields (none = retry)
if redis.call('HGET', KEYS[1], 'state') ~= 'unknown' then return 0 end
if #ARGV == 3 then  -- retry: kept, findable; the next claim takes it over and goes upstream
  redis.call('HSET', KEYS[1], 'state', 'retried')
else
  redis.call('HSET', KEYS[1], unpack(ARGV, 4))
end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""

APPEND_PARTIAL = """
-- KEYS: entry, partial; ARGV: owner, seq, data, channel, kid
-- Only the claim's holder adds to its stream; a seq already there is kept as it was.
local e = redis.call('HMGET', KEYS[1], 'owner', 'state')
if e[1] ~= ARGV[1] or e[2] ~= 'in_flight' then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
"""

READ_PARTIAL = """
-- KEYS: partial; ARGV: after_seq. Returns {seq, data, seq, data, ...} in order.
local seqs = {}
for _, seq in ipairs(redis.call('HKEYS', KEYS[1])) do
  if tonumber(seq) > tonumber(ARGV[1]) then table.insert(seqs, tonumber(seq)) end
end
table.sort(seqs)
local out = {}
for _, seq in ipairs(seqs) do
  table.insert(out, seq)
  table.insert(out, redis.call('HGET', KEYS[1], seq))
end
return out
"""

COUNT_REPLAYS = """
-- KEYS: entries; ARGV: prefix, now, then how many replays each (an expired entry is not
-- brought back). Each is tallied under the current epoch of the entry's run, in its
-- 'replayed' field: {"epoch": [replays, first seen]}.
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local n = tonumber(ARGV[i + 2])
    redis.call('HINCRBY', key, 'replays', n)
    local rk = redis.call('HGET', key, 'rk')
    local epoch = rk and redis.call('HGET', ARGV[1] .. 'run:' .. rk, 'epoch')
    if epoch then
      local raw = redis.call('HGET', key, 'replayed')
      local tally = raw and cjson.decode(raw) or {}
      local seen = tally[epoch] or {0, tonumber(ARGV[2])}
      tally[epoch] = {seen[1] + n, seen[2]}
      redis.call('HSET', key, 'replayed', cjson.encode(tally))
    end
  end
end
"""

PURGE = """
-- KEYS: steps-expiry; ARGV: now_ms, batch, prefix. Entries expire by themselves; this
-- drops what still points at them. Returns {index entries looked at, entries gone}.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local gone = 0
for _, member in ipairs(due) do
  local kid, rk = string.match(member, '^(%x+) (.*)$')
  local ttl = redis.call('PTTL', ARGV[3] .. 'entry:' .. kid)
  if ttl > 0 then  -- alive after all (clocks apart): index it at its real expiry
    redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + ttl, member)
  else
    redis.call('ZREM', ARGV[3] .. 'steps:' .. rk, kid)
    redis.call('ZREM', KEYS[1], member)
    redis.call('DEL', ARGV[3] .. 'partial:' .. kid)
    gone = gone + 1
  end
end
return {#due, gone}
"""

DELETE_JOURNAL = """
-- KEYS: steps, occ, steps-expiry, generation, quarantined; ARGV: prefix, rk
local deleted = 0
for _, kid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  deleted = deleted + redis.call('DEL', ARGV[1] .. 'entry:' .. kid)
  redis.call('ZREM', KEYS[5], kid)
  redis.call('DEL', ARGV[1] .. 'partial:' .. kid)
  redis.call('ZREM', KEYS[3], kid .. ' ' .. ARGV[2])
end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('INCR', KEYS[4])  -- in the same script: see Journal.generation
return deleted
"""

# -- runs: ARGV[1] is the prefix, ARGV[2] the rk (except for TOUCH) -----------------------

RUN_HELPERS = """
local ENDED = LUA_ENDED
local STATES = LUA_STATES
local function write(key, fields)  -- a JSON object of strings; null deletes the field
  for name, value in pairs(fields) do
    if value == cjson.null then redis.call('HDEL', key, name) else redis.call('HSET', key, name, value) end
  end
end
local function remember(p, rk, event)  -- the history keeps the last HISTORY_LIMIT events
  redis.call('RPUSH', p .. 'history:' .. rk, event)
  redis.call('LTRIM', p .. 'history:' .. rk, -HISTORY_LIMIT, -1)
end
local function event(at, epoch, name)
  return '{"at":' .. at .. ',"epoch":' .. epoch .. ',"event":' .. cjson.encode(name) .. '}'
end
local function ending(p, rk, at, epoch, members)  -- base.ending_event: members are JSON's, braces off
  if members ~= '' then
    remember(p, rk, '{"at":' .. at .. ',"epoch":' .. epoch .. ',"event":"ended",' .. members .. '}')
  end
end
local function due(p, rk)  -- when a live run is next due to a supervisor (PostgreSQL's runs.due_at)
  local r = redis.call('HMGET', p .. 'run:' .. rk, 'last_seen', 'timeout_s', 'started_at', 'grace_s',
                       'next_restart_at', 'claimed_until', 'lost_epoch', 'epoch', 'hook')
  local at = 0  -- a lost attempt that a hook can start again: due at once
  if not (r[7] and tonumber(r[7]) == tonumber(r[8]) and r[9]) then
    at = math.max(tonumber(r[1]) + tonumber(r[2]), tonumber(r[3]) + tonumber(r[4]))
  end
  return math.max(at, tonumber(r[5] or 0), tonumber(r[6] or 0))
end
local function reindex(p, rk)  -- after every change: listing by state, when due, purge
  local r = redis.call('HMGET', p .. 'run:' .. rk, 'state', 'created_at', 'last_seen', 'run_id', 'ended_at')
  redis.call('ZADD', p .. 'runs', r[2], rk)
  for _, state in ipairs(STATES) do
    if state ~= r[1] then redis.call('ZREM', p .. 'runs:' .. state, rk) end
  end
  redis.call('ZADD', p .. 'runs:' .. r[1], r[2], rk)
  if ENDED[r[1]] then
    redis.call('ZREM', p .. 'runs-deadline', rk)
  else
    redis.call('ZADD', p .. 'runs-deadline', due(p, rk), rk)
  end
  redis.call('SADD', p .. 'runs-named:' .. r[4], rk)
  redis.call('ZADD', p .. 'runs-idle', math.max(tonumber(r[3]), tonumber(r[5] or 0)), rk)
end
local function reply(p, rk)
  return {redis.call('HGETALL', p .. 'run:' .. rk), redis.call('LRANGE', p .. 'history:' .. rk, 0, -1),
          redis.call('LRANGE', p .. 'restarts:' .. rk, 0, -1)}
end
local p, rk = ARGV[1], ARGV[2]
local run = p .. 'run:' .. (rk or '')
""".replace("HISTORY_LIMIT", str(HISTORY_LIMIT)).replace(
    "LUA_ENDED", "{" + ", ".join(f"{state} = true" for state in sorted(ENDED)) + "}").replace(
    "LUA_STATES", "{" + ", ".join(f"'{state}'" for state in RUN_STATES) + "}")

UPSERT_RUN = RUN_HELPERS + """
-- ARGV[3]: fields of a new run; ARGV[4]: fields an existing one takes; ARGV[5]: history;
-- ARGV[6..]: restart times
if redis.call('EXISTS', run) == 0 then
  write(run, cjson.decode(ARGV[3]))
  for _, item in ipairs(cjson.decode(ARGV[5])) do remember(p, rk, item) end
  for i = 6, #ARGV do redis.call('RPUSH', p .. 'restarts:' .. rk, ARGV[i]) end
else
  write(run, cjson.decode(ARGV[4]))
end
reindex(p, rk)
return reply(p, rk)
"""

OBSERVE_EPOCH = RUN_HELPERS + """
-- ARGV[3]: epoch ('' = none), ARGV[4]: now, ARGV[5]: fields of a new run, ARGV[6]: how the
-- attempt a raise supersedes ended (as for ending()). A new run only at epoch 0 or 1 (an unknown
-- run counts as one at epoch 0); an existing one moves to the next only.
local current = redis.call('HGET', run, 'epoch')
if not current then
  if ARGV[3] ~= '' and tonumber(ARGV[3]) > 1 then return 0 end
  write(run, cjson.decode(ARGV[5]))
elseif ARGV[3] ~= '' and tonumber(ARGV[3]) == tonumber(current) + 1 then
  ending(p, rk, ARGV[4], current, ARGV[6])
  if redis.call('HGET', run, 'state') == 'restarting' then redis.call('HSET', run, 'state', 'running') end
  redis.call('HSET', run, 'epoch', ARGV[3], 'started_at', ARGV[4])
else
  return current
end
reindex(p, rk)
return redis.call('HGET', run, 'epoch')
"""

TOUCH = RUN_HELPERS + """
-- ARGV[2..]: rk, at, epoch ('' = unfenced; a superseded attempt's beat changes nothing), ...
-- A beat moves two indexes (when the run is due, when it was last active); only a restarted
-- run's first beat, which makes it running again, moves the rest (reindex).
for i = 2, #ARGV, 3 do
  local rk, key = ARGV[i], p .. 'run:' .. ARGV[i]
  local r = redis.call('HMGET', key, 'last_seen', 'state', 'epoch', 'ended_at')
  if r[1] and (ARGV[i + 2] == '' or tonumber(r[3]) <= tonumber(ARGV[i + 2])) then
    local seen = tonumber(r[1])
    if tonumber(ARGV[i + 1]) > seen then
      seen = tonumber(ARGV[i + 1])
      redis.call('HSET', key, 'last_seen', ARGV[i + 1])
    end
    if r[2] == 'restarting' then
      redis.call('HSET', key, 'state', 'running')
      reindex(p, rk)
    else
      if not ENDED[r[2]] then redis.call('ZADD', p .. 'runs-deadline', due(p, rk), rk) end
      redis.call('ZADD', p .. 'runs-idle', math.max(seen, tonumber(r[4] or 0)), rk)
    end
  end
end
"""

CLAIM_SILENT_RUNS = RUN_HELPERS + """
-- ARGV[2]: '' (no one run), ARGV[3]: now, ARGV[4]: limit, ARGV[5]: claimed until. The runs due
-- by now, soonest due first, each claimed until ARGV[5] (which moves it in runs-deadline
-- there: no caller finds it due before); their rks.
local found = redis.call('ZRANGEBYSCORE', p .. 'runs-deadline', '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
for _, ref in ipairs(found) do
  redis.call('HSET', p .. 'run:' .. ref, 'claimed_until', ARGV[5])
  redis.call('ZADD', p .. 'runs-deadline', due(p, ref), ref)
end
return found
"""

HEARTBEAT = RUN_HELPERS + """
-- ARGV[3]: at, ARGV[4]: epoch ('' = unfenced; a superseded attempt changes nothing)
local r = redis.call('HMGET', run, 'last_seen', 'state', 'epoch')
if not r[1] then return false end
if ARGV[4] == '' or tonumber(r[3]) <= tonumber(ARGV[4]) then
  if tonumber(ARGV[3]) > tonumber(r[1]) then redis.call('HSET', run, 'last_seen', ARGV[3]) end
  if r[2] == 'restarting' then redis.call('HSET', run, 'state', 'running') end
  reindex(p, rk)
end
return reply(p, rk)
"""

END_RUN = RUN_HELPERS + """
-- ARGV[3]: state, ARGV[4]: now, ARGV[5]: epoch ('' = unfenced; a superseded attempt changes nothing),
-- ARGV[6]: how the attempt ended ('' = not said; redis/runs.py _ending)
local r = redis.call('HMGET', run, 'state', 'epoch')
if not r[1] then return false end
if not ENDED[r[1]] and (ARGV[5] == '' or tonumber(r[2]) <= tonumber(ARGV[5])) then
  redis.call('HSET', run, 'state', ARGV[3], 'ended_at', ARGV[4])
  ending(p, rk, ARGV[4], r[2], ARGV[6])
  remember(p, rk, event(ARGV[4], r[2], ARGV[3]))
  reindex(p, rk)
end
return reply(p, rk)
"""

NEW_ATTEMPT = RUN_HELPERS + """
-- ARGV[3]: expected epoch ('' = any), ARGV[4]: now, ARGV[5]: reason, ARGV[6]: 1 = a restart,
-- ARGV[7]: window ('' = the restart does not count towards max_restarts), ARGV[8]: how the attempt
-- before ended ('' = not said; redis/runs.py _ending)
local r = redis.call('HMGET', run, 'state', 'epoch', 'restarts')
if not r[1] or ENDED[r[1]] then return false end
if ARGV[3] ~= '' and tonumber(r[2]) ~= tonumber(ARGV[3]) then return false end  -- another caller won
ending(p, rk, ARGV[4], r[2], ARGV[8])
local epoch = tonumber(r[2]) + 1
redis.call('HSET', run, 'epoch', epoch, 'restarts', tonumber(r[3]) + tonumber(ARGV[6]),
           'state', ARGV[6] == '1' and 'restarting' or 'running', 'started_at', ARGV[4], 'last_seen', ARGV[4],
           'claimed_until', 0)
remember(p, rk, event(ARGV[4], epoch, ARGV[5]))
if ARGV[7] ~= '' then  -- count it; forget the restarts that have left the window
  local times, since = p .. 'restarts:' .. rk, tonumber(ARGV[4]) - tonumber(ARGV[7])
  while true do
    local oldest = redis.call('LINDEX', times, 0)
    if not oldest or tonumber(oldest) > since then break end
    redis.call('LPOP', times)
  end
  redis.call('RPUSH', times, ARGV[4])
end
reindex(p, rk)
return reply(p, rk)
"""

REVIVE_RUN = RUN_HELPERS + """
-- ARGV[3]: now. A dead run's next attempt (base.revive_attempt): restarting, no longer
-- ended, the restarts that killed it forgotten. Returns false unless the run is dead.
local r = redis.call('HMGET', run, 'state', 'epoch', 'restarts')
if r[1] ~= 'dead' then return false end
local epoch = tonumber(r[2]) + 1
redis.call('HSET', run, 'epoch', epoch, 'restarts', tonumber(r[3]) + 1, 'state', 'restarting',
           'started_at', ARGV[3], 'last_seen', ARGV[3], 'next_restart_at', 0)
redis.call('HDEL', run, 'ended_at')
redis.call('DEL', p .. 'restarts:' .. rk)
remember(p, rk, event(ARGV[3], epoch, 'revive'))
reindex(p, rk)
return reply(p, rk)
"""

SET_RUN_STATE = RUN_HELPERS + """
-- ARGV[3]: fields to set (JSON), ARGV[4]: event to remember ('' = none)
if redis.call('EXISTS', run) == 0 then return 0 end
write(run, cjson.decode(ARGV[3]))
if ARGV[4] ~= '' then remember(p, rk, ARGV[4]) end
reindex(p, rk)
return 1
"""

PURGE_RUNS = RUN_HELPERS + """
-- ARGV[2]: '' (no one run), ARGV[3]: before, ARGV[4]: batch. Deletes the runs neither seen nor
-- ended since before (runs-idle), with everything that indexes them; returns how many.
local due = redis.call('ZRANGEBYSCORE', p .. 'runs-idle', '-inf', '(' .. ARGV[3], 'LIMIT', 0, ARGV[4])
for _, ref in ipairs(due) do
  local f = redis.call('HMGET', p .. 'run:' .. ref, 'state', 'run_id')
  redis.call('DEL', p .. 'run:' .. ref, p .. 'history:' .. ref, p .. 'restarts:' .. ref)
  redis.call('ZREM', p .. 'runs', ref)
  redis.call('ZREM', p .. 'runs-deadline', ref)
  redis.call('ZREM', p .. 'runs-idle', ref)
  if f[1] then redis.call('ZREM', p .. 'runs:' .. f[1], ref) end
  if f[2] then redis.call('SREM', p .. 'runs-named:' .. f[2], ref) end
end
return #due
"""


ATTACH_RUN = RUN_HELPERS + """
-- ARGV[3]: epoch. One more held connection of a live attempt that is not lost.
local r = redis.call('HMGET', run, 'state', 'epoch', 'lost_epoch')
if not r[1] then return false end
local epoch = tonumber(ARGV[3])
if not ENDED[r[1]] and tonumber(r[2]) == epoch and tonumber(r[3]) ~= epoch then
  redis.call('HINCRBY', run, 'attachments', 1)
end
return reply(p, rk)
"""

LOSE_ATTEMPT = RUN_HELPERS + """
-- ARGV[3]: epoch, ARGV[4]: the event (JSON), ARGV[5]: attachment ('' = any), ARGV[6]: channel.
-- Marks the attempt lost while it is current and, with an attachment, not held since.
local r = redis.call('HMGET', run, 'state', 'epoch', 'lost_epoch', 'attachments')
local epoch = tonumber(ARGV[3])
if not r[1] or ENDED[r[1]] or tonumber(r[2]) ~= epoch or tonumber(r[3]) == epoch then return 0 end
if ARGV[5] ~= '' and tonumber(r[4] or '0') ~= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', run, 'lost_epoch', ARGV[3])
remember(p, rk, ARGV[4])
reindex(p, rk)
redis.call('PUBLISH', ARGV[6], 'RUN_LOST')
return 1
""".replace("RUN_LOST", RUN_LOST)

READ_ONLY = frozenset({"read", "recorded", "read_partial"})  # the scripts that write nothing


def sharded(source: str) -> str:
    """A script for Redis Cluster: its notifications on the sharded channel, in its own slot."""
    return source.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")


SCRIPTS = {
    "read": READ, "recorded": RECORDED, "replay_occurrence": REPLAY_OCCURRENCE,
    "claim": CLAIM, "renew": RENEW, "complete": COMPLETE, "release": RELEASE, "set_state": SET_STATE,
    "resolve": RESOLVE, "append_partial": APPEND_PARTIAL, "read_partial": READ_PARTIAL,
    "count_replays": COUNT_REPLAYS, "purge": PURGE, "delete_journal": DELETE_JOURNAL,
    "upsert_run": UPSERT_RUN, "observe_epoch": OBSERVE_EPOCH, "touch": TOUCH,
    "claim_silent_runs": CLAIM_SILENT_RUNS, "heartbeat": HEARTBEAT,
    "end_run": END_RUN,
    "new_attempt": NEW_ATTEMPT, "set_run_state": SET_RUN_STATE, "purge_runs": PURGE_RUNS,
    "attach_run": ATTACH_RUN, "lose_attempt": LOSE_ATTEMPT,
    "revive_run": REVIVE_RUN,
}
