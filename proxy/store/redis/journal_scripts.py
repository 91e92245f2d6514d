"""The Redis store's Lua scripts for the journal: a claim, a record, a replay's read, a
decision, a purge, each atomic. Conventions: see :mod:`.scripts`.

Each script touches one shard (:mod:`.shards`): an entry's, or a run's. A claim of a run's
entry whose run is in the same shard is one script (CLAIM with its run's keys); else CLAIM
and then ENTER_STEP in the run's shard. Releases, a run's journal and purges always go in
two steps, entry side and run side (:mod:`.journal`).
"""

ENTRY_FIELDS = ("kid", "tenant", "run", "epoch", "upstream", "key", "fingerprint", "state", "owner",
                "lease_until", "created_at", "completed_at", "expires_at", "replays", "detail",
                "method", "path", "namespace")  # an Entry's hash fields, besides its response
# What a read returns, in this order: a list of values parses faster than a hash's pairs.
READ_FIELDS = (*ENTRY_FIELDS, "status", "headers", "body", "streamed", "timing", "evidence")

CLAIM = """
-- KEYS: entry, partial, run, steps, steps-expiry, quarantined. Returns {'won'}, {'stale', epoch} or
-- {'taken', the entry's READ_FIELDS}
-- ARGV: now, epoch ('' = unfenced), fingerprint, owner, on_expired, expires_ms, kid, index member
--       ('' = not indexed here), the new entry's fields (a JSON object of strings: one argument
--       packs faster than forty). With both '' the run's keys are not touched (its shard is another);
--       ARGV[10] = '1' then asks first: {'takeover'}, changing nothing, where the claim would change an
--       entry that is there (take it over, or quarantine it), so the run's epoch is checked before.
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
  if ARGV[10] == '1' then return {'takeover'} end
  if ARGV[5] == 'quarantine' then  -- its proxy died mid-call: the outcome is unknown
    redis.call('HSET', KEYS[1], 'state', 'unknown', 'detail', 'the proxy holding the claim stopped mid-call')
    redis.call('HDEL', KEYS[1], 'owner')
    redis.call('DEL', KEYS[2])
    redis.call('ZADD', KEYS[6], math.floor(tonumber(redis.call('HGET', KEYS[1], 'expires_at')) * 1000), ARGV[7])
    return {'taken', redis.call('HMGET', KEYS[1], READ_FIELDS)}
  end
end
if e[1] and ARGV[10] == '1' then return {'takeover'} end
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

ENTER_STEP = """
-- KEYS: run, steps, steps-expiry; ARGV: epoch ('' = unfenced), now, kid, index member, expires_ms,
-- won ('1': the claim wrote the entry; '': it found it there). After a claim in the entry's
-- shard: {'stale', epoch} if the run has moved past the epoch (the caller frees a claim that
-- won), else the step is in its run's journal: {'entered'}. A claim that won indexes its step
-- at its own times, as CLAIM does (UNINDEX_STEP and PURGE_STEPS then leave it be); a replay
-- (NX) keeps the times there, and lists again a step a crash left out.
if ARGV[1] ~= '' then
  local epoch = redis.call('HGET', KEYS[1], 'epoch')
  if epoch and tonumber(epoch) > tonumber(ARGV[1]) then return {'stale', epoch} end
end
if ARGV[6] == '1' then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
else
  redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[3])
  redis.call('ZADD', KEYS[3], 'NX', ARGV[5], ARGV[4])
end
return {'entered'}
"""

# KEYS: entry. The entry's READ_FIELDS: a script, because a command naming the 23 fields
# costs the proxy more to pack than the whole read costs the server.
READ = """return redis.call('HMGET', KEYS[1], READ_FIELDS)"""

CLAIM, READ = (script.replace("READ_FIELDS", ", ".join(f"'{name}'" for name in READ_FIELDS))
               for script in (CLAIM, READ))

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
-- KEYS: entry, partial; ARGV: owner, channel, kid. Deletes the claim if the owner holds it;
-- returns false, or what UNINDEX_STEP needs of it: rk (or false), key, epoch, fingerprint,
-- tenant, created_at, expires_at
local e = redis.call('HMGET', KEYS[1], 'owner', 'rk', 'key', 'epoch', 'fingerprint', 'tenant', 'created_at',
                     'expires_at')
local gone = false
if e[1] == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  gone = {e[2] or false, e[3], e[4] or '-1', e[5], e[6], e[7], e[8]}
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return gone
"""

UNINDEX_STEP = """
-- KEYS: steps, steps-expiry, occ; ARGV: kid, index member, created_at, expires_ms, key, epoch,
-- fingerprint, tenant. After RELEASE deleted a run's claim: the step leaves its run's journal,
-- unless a claim since (the same step again, in one script with its run) indexed it anew, later.
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) <= tonumber(ARGV[3]) then redis.call('ZREM', KEYS[1], ARGV[1]) end
local due = redis.call('ZSCORE', KEYS[2], ARGV[2])
if due and tonumber(due) <= tonumber(ARGV[4]) then redis.call('ZREM', KEYS[2], ARGV[2]) end
local n = string.match(ARGV[5], '^derived:.*:(%d+)$')
if n then  -- give the occurrence number back, so the caller's retry maps onto this slot
  -- counted per tenant: the field is "{epoch}:" .. rules.counted(tenant, fingerprint)
  local field = ARGV[6] .. ':' .. ARGV[8] .. ' ' .. ARGV[7]
  if tonumber(redis.call('HGET', KEYS[3], field)) == tonumber(n) + 1 then
    redis.call('HINCRBY', KEYS[3], field, -1)
  end
end
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
-- KEYS: entry, quarantined; ARGV: channel, kid, then the answer's fields (none = retry)
if redis.call('HGET', KEYS[1], 'state') ~= 'unknown' then return 0 end
if #ARGV == 2 then  -- retry: kept, findable; the next claim takes it over and goes upstream
  redis.call('HSET', KEYS[1], 'state', 'retried')
else
  redis.call('HSET', KEYS[1], unpack(ARGV, 3))
end
redis.call('ZREM', KEYS[2], ARGV[2])
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
-- KEYS: entries of one shard; ARGV: now, then for each how many replays and the current epoch
-- of its run ('' = none; read from the run's shard first). An expired entry is not brought
-- back. Each is tallied under that epoch in its 'replayed' field: {"epoch": [replays, first seen]}.
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local n, epoch = tonumber(ARGV[2 * i]), ARGV[2 * i + 1]
    redis.call('HINCRBY', key, 'replays', n)
    if epoch ~= '' then
      local raw = redis.call('HGET', key, 'replayed')
      local tally = raw and cjson.decode(raw) or {}
      local seen = tally[epoch] or {0, tonumber(ARGV[1])}
      tally[epoch] = {seen[1] + n, seen[2]}
      redis.call('HSET', key, 'replayed', cjson.encode(tally))
    end
  end
end
"""

PURGE_STEPS = """
-- KEYS: steps-expiry; ARGV: now_ms, prefix, then index member and the entry's PTTL, ... (read
-- from the entries' shards just before). Entries expire by themselves, and their streams in
-- flight with them (APPEND_PARTIAL); this drops what still points at them. Returns how many
-- entries were gone.
local gone = 0
for i = 3, #ARGV, 2 do
  local member, ttl = ARGV[i], tonumber(ARGV[i + 1])
  local kid, rk = string.match(member, '^(%x+) (.*)$')
  local due = tonumber(redis.call('ZSCORE', KEYS[1], member))
  if ttl > 0 then  -- alive after all (clocks apart): index it at its real expiry
    redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + ttl, member)
  elseif due and due <= tonumber(ARGV[1]) then  -- not claimed again since it was read
    redis.call('ZREM', ARGV[2] .. 'steps:' .. rk, kid)
    redis.call('ZREM', KEYS[1], member)
    gone = gone + 1
  end
end
return gone
"""

DELETE_ENTRIES = """
-- KEYS: quarantined, then each entry and its stream in flight, of one shard; ARGV: their kids.
-- Returns how many entries there were.
local deleted = 0
for i = 1, #ARGV do
  deleted = deleted + redis.call('DEL', KEYS[2 * i])
  redis.call('DEL', KEYS[2 * i + 1])
  redis.call('ZREM', KEYS[1], ARGV[i])
end
return deleted
"""

DELETE_STEPS = """
-- KEYS: steps, occ, steps-expiry; ARGV: rk, then each kid DELETE_ENTRIES deleted and its score in
-- steps when read. A run's journal index, after its entries are gone: a step claimed again
-- meanwhile (indexed anew, at another score) stays listed.
for i = 2, #ARGV, 2 do
  if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[i])) == tonumber(ARGV[i + 1]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[3], ARGV[i] .. ' ' .. ARGV[1])
  end
end
redis.call('DEL', KEYS[2])
"""


JOURNAL_SCRIPTS = {
    "read": READ, "replay_occurrence": REPLAY_OCCURRENCE, "claim": CLAIM, "enter_step": ENTER_STEP,
    "renew": RENEW, "complete": COMPLETE, "release": RELEASE, "unindex_step": UNINDEX_STEP,
    "set_state": SET_STATE, "resolve": RESOLVE, "append_partial": APPEND_PARTIAL, "read_partial": READ_PARTIAL,
    "count_replays": COUNT_REPLAYS, "purge_steps": PURGE_STEPS, "delete_entries": DELETE_ENTRIES,
    "delete_steps": DELETE_STEPS,
}
