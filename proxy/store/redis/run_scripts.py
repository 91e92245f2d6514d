"""The Redis store's Lua scripts for runs: each change to a run, with its history and its
indexes (by state, by when it is due, by name, for purging), atomic. Every script starts
with RUN_HELPERS. Conventions: see :mod:`.scripts`.
"""

from ..model import ENDED, RUN_STATES
from ..rules import HISTORY_LIMIT
from ..waking import RUN_LOST

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
local function ending(p, rk, at, epoch, members)  -- rules.ending_event: members are JSON's, braces off
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
-- ARGV[2]: '' (no one run), ARGV[3]: now, ARGV[4]: limit, ARGV[5]: claimed until, ARGV[6..]: the
-- rks to claim (none: the soonest due). The runs due by now, soonest due first, each claimed
-- until ARGV[5] (which moves it in runs-deadline there: no caller finds it due before); their rks.
local found = {}
if #ARGV > 5 then  -- those still due: another supervisor may have claimed one since it was read
  for i = 6, #ARGV do
    local at = redis.call('ZSCORE', p .. 'runs-deadline', ARGV[i])
    if at and tonumber(at) <= tonumber(ARGV[3]) then found[#found + 1] = ARGV[i] end
  end
else
  found = redis.call('ZRANGEBYSCORE', p .. 'runs-deadline', '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
end
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
-- ARGV[3]: now. A dead run's next attempt (rules.revive_attempt): restarting, no longer
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


RUN_SCRIPTS = {
    "upsert_run": UPSERT_RUN, "observe_epoch": OBSERVE_EPOCH, "touch": TOUCH,
    "claim_silent_runs": CLAIM_SILENT_RUNS, "heartbeat": HEARTBEAT, "end_run": END_RUN,
    "new_attempt": NEW_ATTEMPT, "set_run_state": SET_RUN_STATE, "purge_runs": PURGE_RUNS,
    "attach_run": ATTACH_RUN, "lose_attempt": LOSE_ATTEMPT, "revive_run": REVIVE_RUN,
}
