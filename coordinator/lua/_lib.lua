-- Shared prelude: coordinator/scripts.py prepends to each script the definitions
-- below that it uses (directly or through another one).
-- KEYS[1..16] are the pool keys in coordinator/keys.py COLUMNS order; every script
-- receives all of them, plus script-specific keys from KEYS[17] on.
-- Times are the Redis server clock in ms. Errors are "LCERR <kind> <detail>".

local K_META, K_SPEC_LOG, K_SPEC, K_EPOCH = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LAST_SEEN, K_MAX_SLOTS, K_SLOT, K_HINTS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_RES, K_BY_INSTANCE, K_NODES = KEYS[9], KEYS[10], KEYS[11]
local K_STATE, K_LIVE, K_FREE_SLOTS = KEYS[12], KEYS[13], KEYS[14]
local K_VOIDS, K_RETIRED = KEYS[15], KEYS[16]
local HINTS = {'engine_running', 'engine_waiting', 'queue_depth'}
-- Packed records (coordinator/packed.py decodes them), one per slot. A field is a
-- fixed number of base-128 digits, most significant first, each byte 0..127: plain
-- ASCII, so clients that decode replies as text read them unchanged.
-- state (the source of truth for an instance's reservation counters): pending_prefill,
--   active_decode (3 digits each, saturating; inflight is their sum),
--   prefill_free_at_ms, earliest_end_at_ms (6 digits: ms to the year 2109; 0 = no live
--   reservation), pending_prefill_ms (6 digits: the prefill work of its prefill-phase
--   reservations), started (3 digits: the reservations reserve.lua ever placed on the
--   slot, modulo STARTED_WRAP; zeroed with the slot)
-- live: last_seen_ms (6), then per hint: value*1000 (4, saturating), at_ms (6; 0 = none)
local STATE_BYTES, LIVE_BYTES = 27, 36
local STARTED_WRAP = 2097152  -- 128^3: `started` counts modulo this
local SPEC_LOG_MAX = 10000  -- spec changes kept for incremental readers; older: full read
local SWEEP_BUDGET = 250  -- reservations one call may void; the rest is swept later

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fail(kind, detail)
  return redis.error_reply('LCERR ' .. kind .. ' ' .. detail)
end

-- A non-negative integer argument, or nil when it is not one. (`n % 1` is 0 for an
-- integer and NaN for NaN and the infinities: no call of math.floor.)
local function int_arg(value, max)
  local n = tonumber(value)
  if n == nil or n < 0 or n % 1 ~= 0 or n > (max or 1e15) then
    return nil
  end
  if n == 0 then return 0 end  -- '-0' would reach Redis as "-0", which HINCRBY rejects
  return n
end

local function valid_id(value)
  return type(value) == 'string' and #value > 0 and #value <= 128
    and string.find(value, '^[%w][%w%.:_%-]*$') ~= nil
end

-- Whether `value` is '' or an SCAN cursor Redis accepts: decimal, below 2^64.
local function valid_cursor(value)
  if value == '' then return true end
  if type(value) ~= 'string' or #value > 20 or not string.find(value, '^%d+$') then
    return false
  end
  return #value < 20 or value <= '18446744073709551615'
end

local function num(key, id)
  return tonumber(redis.call('HGET', key, id) or '0')
end

-- Ensure the pool's meta hash exists; run_id changes when Redis lost the pool.
local function run_id(now)
  local id = redis.call('HGET', K_META, 'run_id')
  if not id then
    id = string.format('%d-%d', now, math.random(1, 1000000000))
    redis.call('HSET', K_META, 'run_id', id, 'created_ms', string.format('%d', now))
  end
  return id
end

-- Record a change of instance `id`'s spec, epoch, max_slots or membership: nodes
-- re-read exactly these ids (spec_log), so a spec is never resent unchanged.
local function spec_changed(id, now)
  run_id(now)
  local gen = redis.call('HINCRBY', K_META, 'spec_gen', 1)
  redis.call('ZADD', K_SPEC_LOG, gen, id)
  local excess = redis.call('ZCARD', K_SPEC_LOG) - SPEC_LOG_MAX
  if excess > 0 then redis.call('ZREMRANGEBYRANK', K_SPEC_LOG, 0, excess - 1) end
  return gen
end

-- `v` (an integer >= 0, saturated at 128^n - 1) as n base-128 digits.
local function be(v, n)
  v = math.floor(tonumber(v) or 0)
  if v < 0 then v = 0 end
  local cap = 128 ^ n - 1
  if v > cap then v = cap end
  local t = {}
  for i = n, 1, -1 do
    t[i] = v % 128
    v = math.floor(v / 128)
  end
  return string.char((table.unpack or unpack)(t))
end

-- Index member of a reservation: '<id>#<epoch:010d>|<end_at_ms:015d>|<rid>', so one
-- instance's current epoch is one lex range, ordered by predicted end.
local function lex_member(id, epoch, end_at, rid)
  return string.format('%s#%010d|%015d|%s', id, epoch, end_at, rid)
end

-- A reservation record as stored: JSON (cjson.decode reads it), formatted directly
-- at half the cost of cjson.encode. Ids are validated ids and phase is
-- 'prefill' or 'decode', so nothing needs escaping. `slot` is the instance's slot in
-- the packed records when the record was written (-1: not known; see record_state).
-- One literal (Lua 5.1 does not fold '..' of constants: it would run on every call).
local RECORD_JSON = '{"instance":"%s","epoch":%d,"node":"%s","phase":"%s","prompt_tokens":%d,"expected_output_tokens":%d,"prefill_ms":%d,"decode_ms":%d,"created_ms":%d,"first_token_at_ms":%d,"end_at_ms":%d,"predicted_ttft_ms":%d,"slot":%d}'

local function encode_record(r)
  return string.format(RECORD_JSON, r.instance, r.epoch, r.node, r.phase, r.prompt_tokens,
    r.expected_output_tokens, r.prefill_ms, r.decode_ms, r.created_ms, r.first_token_at_ms,
    r.end_at_ms, r.predicted_ttft_ms, r.slot or -1)
end

local function epoch_range(id, epoch)
  return string.format('[%s#%010d|', id, epoch), string.format('(%s#%010d}', id, epoch)
end

-- Longest predicted prefill or decode time (ms): one day. Callers clamp predictions
-- to it (coordinator/models.py MAX_PREDICTED_MS), so a valid request always fits.
local MAX_PREDICTED_MS = 86400000

-- Re-chain the serialized prefill cursor of state `st` after prefill reservation `rec`
-- left before its first token (release, reap); st.pending_ms already excludes it.
-- Prefill is serialized FCFS (local_fleet/engine_model.py):
-- - its prefill had not started (predicted start after now): only its share leaves
--   the chain; the prefill in progress keeps the progress it made, so the cursor
--   moves back by exactly its prefill_ms;
-- - its prefill had started: the engine finishes that iteration anyway, so the
--   cursor stays, but never below now + the prefill work still queued.
local function rechain_after_cancel(st, rec, now)
  local first_token_at = tonumber(rec.first_token_at_ms) or now
  local prefill_ms = tonumber(rec.prefill_ms) or 0
  if first_token_at - prefill_ms > now then
    st.free_at = math.max(now, st.free_at - prefill_ms)
  else
    st.free_at = math.max(st.free_at, now + st.pending_ms)
  end
end

-- Whether `node` holds a lease now (its deadline has not passed).
local function lease_held(node, now)
  local deadline = redis.call('ZSCORE', K_NODES, node)
  return deadline ~= false and deadline ~= nil and tonumber(deadline) >= now
end

local function earliest_end(id, epoch)
  local lo, hi = epoch_range(id, epoch)
  local first = redis.call('ZRANGEBYLEX', K_BY_INSTANCE, lo, hi, 'LIMIT', 0, 1)
  if #first == 0 then return 0 end
  return tonumber(string.match(first[1], '|(%d+)|'))
end

-- `v` (an integer) as 3 or 6 base-128 digits, saturating, negatives as 0: be(v, 3)
-- and be(v, 6) without a table (they run on every reservation transition).
local function be3(v)
  if v < 0 then v = 0 elseif v > 2097151 then v = 2097151 end
  local c = v % 128
  v = (v - c) / 128
  local b = v % 128
  return string.char((v - b) / 128, b, c)
end

local function be6(v)
  if v < 0 then v = 0 elseif v > 4398046511103 then v = 4398046511103 end
  local f = v % 128
  v = (v - f) / 128
  local e = v % 128
  v = (v - e) / 128
  local d = v % 128
  v = (v - d) / 128
  local c = v % 128
  v = (v - c) / 128
  local b = v % 128
  return string.char((v - b) / 128, b, c, d, e, f)
end

-- The six fields (pending, decode, free_at, earliest, pending_ms, started) of the
-- packed state record at byte `at` (0-based) of `raw`, from one string.byte call into
-- locals: no table, no loop, no substring (every transition reads one, a reserve's
-- walk several).
local function decode_state(raw, at)
  local a1, a2, a3, b1, b2, b3, c1, c2, c3, c4, c5, c6, d1, d2, d3, d4, d5, d6,
    e1, e2, e3, e4, e5, e6, f1, f2, f3 = string.byte(raw, at + 1, at + STATE_BYTES)
  return (a1 * 128 + a2) * 128 + a3, (b1 * 128 + b2) * 128 + b3,
    ((((c1 * 128 + c2) * 128 + c3) * 128 + c4) * 128 + c5) * 128 + c6,
    ((((d1 * 128 + d2) * 128 + d3) * 128 + d4) * 128 + d5) * 128 + d6,
    ((((e1 * 128 + e2) * 128 + e3) * 128 + e4) * 128 + e5) * 128 + e6,
    (f1 * 128 + f2) * 128 + f3
end

-- The instances' decoded state records this call read, by id: one table per instance,
-- so every change in the call (a reserve's decision, its carried transitions, its own
-- write) works on the same copy.
local slot_states = {}

-- Records of slots lo..hi of `state` read by one GETRANGE ahead of their use
-- (prefetch_states), or nil; dropped once anything writes `state`.
local state_span = nil

-- Read the records of these slots (numbers; -1 or nil: none) in one GETRANGE when
-- they lie within `max_bytes` of each other: a reserve walking past its first
-- candidate then reads each of the others without a command of its own.
local function prefetch_states(slots, max_bytes)
  local lo, hi = nil, nil
  for _, s in pairs(slots) do
    if s and s >= 0 then
      if lo == nil or s < lo then lo = s end
      if hi == nil or s > hi then hi = s end
    end
  end
  if lo == nil or lo == hi or (hi - lo + 1) * STATE_BYTES > max_bytes then return end
  local size = (hi - lo + 1) * STATE_BYTES
  local raw = redis.call('GETRANGE', K_STATE, lo * STATE_BYTES, lo * STATE_BYTES + size - 1)
  -- past the end of `state` (a slot not written yet, or a key lost) every field is 0
  if #raw < size then raw = raw .. string.rep('\0', size - #raw) end
  state_span = {lo = lo, hi = hi, raw = raw}
end

-- The six fields of slot `slot`'s state record (decode_state), as Redis has them now
-- (zeros past the end of `state`): from the prefetched span, or one GETRANGE.
local function state_fields(slot)
  local span = state_span
  if span and slot >= span.lo and slot <= span.hi then
    return decode_state(span.raw, (slot - span.lo) * STATE_BYTES)
  end
  local at = slot * STATE_BYTES
  local raw = redis.call('GETRANGE', K_STATE, at, at + STATE_BYTES - 1)
  if #raw < STATE_BYTES then return 0, 0, 0, 0, 0, 0 end
  return decode_state(raw, 0)
end

-- Keep instance `id`'s state, read as these fields, as this call's copy of it:
-- {slot, pending, decode, free_at, earliest, pending_ms, started, base}, `base` the
-- inflight last written. Change the fields, then write_state.
local function adopt_state(id, slot, pending, decode, free_at, earliest, pending_ms, started)
  local st = {slot = slot, pending = pending, decode = decode, free_at = free_at,
    earliest = earliest, pending_ms = pending_ms, started = started,
    base = pending + decode}
  slot_states[id] = st
  return st
end

-- Instance `id`'s state (adopt_state), read once per call; nil when `id` has no slot
-- (`slot`: its value in the slot hash, false when it has none).
local function slot_state_at(id, slot)
  local st = slot_states[id]
  if st then return st end
  if not slot then return nil end
  slot = tonumber(slot)
  return adopt_state(id, slot, state_fields(slot))
end

-- slot_state_at with the slot looked up (HGET slot).
local function slot_state(id)
  return slot_states[id] or slot_state_at(id, redis.call('HGET', K_SLOT, id))
end

-- The state of the instance a reservation record is on, for a record whose epoch is
-- the instance's current one: the slot the record keeps is then still the
-- instance's (a slot changes hands only by unregister, and an id registered again
-- continues above the epochs its remaining records carry: register.lua), so no slot
-- lookup. A record written before records kept slots looks it up.
local function record_state(rec)
  local slot = rec.slot
  if slot == nil or slot < 0 then return slot_state(rec.instance) end
  return slot_states[rec.instance] or slot_state_at(rec.instance, slot)
end

-- This call's copy of the pool's change counters in meta: state_ver (every change of
-- `state` bumps it by one, so a node holding the version before a change can apply
-- that change's record alone) and inflight_total (the live reservations of the whole
-- pool: the sum over `state`). Read once, written once by commit_state; run_id,
-- spec_gen and tie_last (the slot reserve.lua last took from tied candidates, -1
-- for none; `turned` when it moved) come with them (false and 0 when meta does not
-- exist).
local pool_meta = nil

local function pool_counts()
  if not pool_meta then
    local m = redis.call('HMGET', K_META, 'state_ver', 'inflight_total', 'run_id', 'spec_gen',
      'tie_last')
    pool_meta = {ver = tonumber(m[1]) or 0, total = tonumber(m[2]) or 0, dirty = false,
      run = m[3], spec_gen = tonumber(m[4]) or 0, tie_last = tonumber(m[5]) or -1}
  end
  return pool_meta
end

-- Write back what write_state changed; every script that writes `state` ends with it.
local function commit_state()
  if pool_meta and pool_meta.dirty then
    if pool_meta.turned then
      redis.call('HSET', K_META, 'state_ver', pool_meta.ver, 'inflight_total', pool_meta.total,
        'tie_last', pool_meta.tie_last)
    else
      redis.call('HSET', K_META, 'state_ver', pool_meta.ver, 'inflight_total', pool_meta.total)
    end
    pool_meta.dirty = false
  end
end

-- Rewrite the packed record of slot_state `st`. Returns {state_ver, slot, record}.
local function write_state(st)
  local record = be3(st.pending) .. be3(st.decode) .. be6(st.free_at) .. be6(st.earliest)
    .. be6(st.pending_ms) .. be3(st.started % STARTED_WRAP)
  redis.call('SETRANGE', K_STATE, st.slot * STATE_BYTES, record)
  state_span = nil
  local p = pool_counts()
  local inflight = st.pending + st.decode
  p.ver, p.total, p.dirty = p.ver + 1, p.total + inflight - st.base, true
  st.base = inflight
  return {p.ver, st.slot, record}
end

-- Keep st.earliest (the earliest predicted end among the instance's live reservations)
-- after a reservation ending at `end_at` joined, or left (`left`: then re-read from the
-- index when it may have been the earliest; call after the index changed).
local function earliest_joined(st, end_at)
  if st.earliest == 0 or end_at < st.earliest then st.earliest = end_at end
end

local function earliest_left(st, id, epoch, end_at)
  if st.pending + st.decode == 0 then
    st.earliest = 0  -- the counters count exactly the live reservations of this epoch
  elseif st.earliest == 0 or end_at <= st.earliest then
    st.earliest = earliest_end(id, epoch)
  end
end

-- Keep st.earliest after a reservation's predicted end moved from `old_end` to
-- `new_end` (call after the index changed). An end that moved earlier leaves the
-- earliest at min(earliest, new_end) whichever reservation held it: the index is
-- re-read only when the earliest itself moved later.
local function earliest_moved(st, id, epoch, old_end, new_end)
  if new_end <= old_end and st.earliest > 0 then
    if new_end < st.earliest then st.earliest = new_end end
  else
    earliest_left(st, id, epoch, old_end)
    earliest_joined(st, new_end)
  end
end

-- The hint arguments ARGV[2..4] (engine_running, engine_waiting, queue_depth: a
-- number >= 0, or '' when not reported): an error reply, or nil when all are valid.
local function bad_hint_args()
  for i = 2, 4 do
    if ARGV[i] ~= '' then
      local v = tonumber(ARGV[i])
      if v == nil or v ~= v or v < 0 or v > 1e12 then
        return fail('bad_arg', HINTS[i - 1] .. ' must be a number >= 0')
      end
    end
  end
  return nil
end

-- Store the reported hints of ARGV[2..4] for `id`, stamped with the Redis time.
local function store_hint_args(id, now)
  for i = 2, 4 do
    if ARGV[i] ~= '' then
      local name = id .. ':' .. HINTS[i - 1]
      -- Stored re-formatted: Lua reads '0x10' or ' 5', the Python reader may not.
      local value = string.format('%.17g', tonumber(ARGV[i]))
      redis.call('HSET', K_HINTS, name, value, name .. '_at_ms', string.format('%d', now))
    end
  end
end

-- Rewrite instance `id`'s packed liveness record (last_seen and hints).
local function sync_live(id)
  local slot = redis.call('HGET', K_SLOT, id)
  if not slot then return end
  local parts = {be(num(K_LAST_SEEN, id), 6)}
  for _, name in ipairs(HINTS) do
    local at = redis.call('HGET', K_HINTS, id .. ':' .. name .. '_at_ms')
    local value = at and tonumber(redis.call('HGET', K_HINTS, id .. ':' .. name)) or 0
    table.insert(parts, be(math.floor(value * 1000 + 0.5), 4) .. be(at or 0, 6))
  end
  redis.call('SETRANGE', K_LIVE, tonumber(slot) * LIVE_BYTES, table.concat(parts))
end

-- Give `id` a slot in the packed records: a freed one (lowest first) or a new one.
local function alloc_slot(id)
  local slot = redis.call('HGET', K_SLOT, id)
  if slot then return tonumber(slot) end
  local freed = redis.call('ZPOPMIN', K_FREE_SLOTS)
  if #freed > 0 then
    slot = tonumber(freed[1])
  else
    slot = redis.call('HINCRBY', K_META, 'slots', 1) - 1
  end
  redis.call('HSET', K_SLOT, id, slot)
  return slot
end

-- Return `id`'s slot to the free list, zeroing its records (and so its counters:
-- the caller voids its reservations).
local function free_slot(id)
  local st = slot_state(id)
  if not st then return end
  redis.call('HDEL', K_SLOT, id)
  st.pending, st.decode, st.free_at, st.earliest, st.pending_ms, st.started = 0, 0, 0, 0, 0, 0
  write_state(st)
  slot_states[id] = nil
  redis.call('SETRANGE', K_LIVE, st.slot * LIVE_BYTES, string.rep('\0', LIVE_BYTES))
  redis.call('ZADD', K_FREE_SLOTS, st.slot, st.slot)
end

-- Remove one reservation and its counters. `rec` is the decoded record. With a
-- `touched` table (id -> slot_state), the instance's packed record is left for the
-- caller to rewrite once per instance (sync_touched), not once per reservation;
-- without one, returns the state patch (write_state), or nil when no counter moved.
local function drop_reservation(rid, rec, now, touched)
  local id = rec.instance
  redis.call('HDEL', K_RES, rid)
  redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.epoch, rec.end_at_ms, rid))
  if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then
    return nil  -- the instance restarted or left: its counters were reset then
  end
  local st = touched and touched[id]
  if not st then
    st = record_state(rec)
    if not st then return nil end
  end
  if rec.phase == 'prefill' then
    st.pending = math.max(0, st.pending - 1)
    st.pending_ms = math.max(0, st.pending_ms - rec.prefill_ms)
    rechain_after_cancel(st, rec, now)
  else
    st.decode = math.max(0, st.decode - 1)
  end
  if touched then
    st.left = math.min(st.left or rec.end_at_ms, rec.end_at_ms)
    st.epoch = rec.epoch
    touched[id] = st
    return nil
  end
  earliest_left(st, id, rec.epoch, rec.end_at_ms)
  return write_state(st)
end

local function sync_touched(touched)
  for id, st in pairs(touched) do
    earliest_left(st, id, st.epoch, st.left)
    write_state(st)
  end
end

-- Void every reservation of `id` older than its current epoch (all of them once the
-- id is unregistered): counters restart at 0 now, the prefill cursor at `now`; the
-- records themselves are deleted in bounded steps (sweep), so one call never runs
-- long. Returns the reservations voided.
local function void_instance(id, now)
  redis.call('SADD', K_VOIDS, id)
  local st = slot_state(id)
  if not st then return 0 end
  local voided = st.base
  st.pending, st.decode, st.free_at, st.earliest, st.pending_ms = 0, 0, now, 0, 0
  write_state(st)
  return voided
end

-- Delete up to `budget` void reservation records; returns {deleted, ids_left}.
local function sweep(budget)
  local deleted = 0
  for _, id in ipairs(redis.call('SRANDMEMBER', K_VOIDS, 16)) do
    if deleted >= budget then break end
    local epoch = redis.call('HGET', K_EPOCH, id)
    local hi = '(' .. id .. '$'  -- '#' < '$': every epoch of this id
    if epoch then hi = '(' .. id .. '#' .. string.format('%010d', tonumber(epoch)) .. '|' end
    local want = budget - deleted
    local members = redis.call('ZRANGEBYLEX', K_BY_INSTANCE, '[' .. id .. '#', hi,
      'LIMIT', 0, want)
    for _, member in ipairs(members) do
      redis.call('HDEL', K_RES, string.match(member, '|%d+|(.*)$'))
      redis.call('ZREM', K_BY_INSTANCE, member)
    end
    deleted = deleted + #members
    if #members < want then
      redis.call('SREM', K_VOIDS, id)
      redis.call('HDEL', K_RETIRED, id)
    end
  end
  return {deleted, redis.call('SCARD', K_VOIDS)}
end

-- Move reservation `rid` from prefill to decode: its first token came now.
-- Returns 'ok' and this change's state patch (nil when no counter moved: the
-- instance restarted or left since), or 'noop' (unknown rid, or already in decode).
local function first_token(rid, now)
  local raw = redis.call('HGET', K_RES, rid)
  if not raw then return 'noop' end
  local rec = cjson.decode(raw)
  if rec.phase ~= 'prefill' then return 'noop' end
  local id, old_end = rec.instance, rec.end_at_ms
  redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.epoch, old_end, rid))
  rec.phase = 'decode'
  rec.first_token_at_ms = now
  rec.end_at_ms = now + rec.decode_ms
  redis.call('HSET', K_RES, rid, encode_record(rec))
  redis.call('ZADD', K_BY_INSTANCE, '0', lex_member(id, rec.epoch, rec.end_at_ms, rid))
  if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then return 'ok' end
  local st = record_state(rec)
  if not st then return 'ok' end
  st.pending = math.max(0, st.pending - 1)
  st.decode = st.decode + 1
  st.pending_ms = math.max(0, st.pending_ms - rec.prefill_ms)
  -- Its prefill just ended, so the prefills queued behind it start now, one after
  -- another.
  st.free_at = now + st.pending_ms
  earliest_moved(st, id, rec.epoch, old_end, rec.end_at_ms)
  return 'ok', write_state(st)
end

-- End reservation `rid` of the node whose reservation set is `rids_key`. Returns
-- 'ok' and this change's state patch (nil when no counter moved), or 'noop' (the rid
-- is unknown: released or reaped).
local function release_one(rid, rids_key, now)
  redis.call('SREM', rids_key, rid)
  local raw = redis.call('HGET', K_RES, rid)
  if not raw then return 'noop' end
  return 'ok', drop_reservation(rid, cjson.decode(raw), now)
end

-- A transition's reply: {status, state_ver, slot, record}, or {status} alone when no
-- counter moved.
local function transition_reply(status, patch)
  if not patch then return {status} end
  return {status, patch[1], patch[2], patch[3]}
end

-- Transitions one call may carry: nodes send at most coordinator.coordinator.CARRY_STEP
-- (32), so a call's work stays bounded (20-50 µs of Redis time each).
local MAX_CARRIED = 64

-- Prefix records one call may carry (nodes send at most 8: coordinator/held_records.py).
local MAX_RECORDS = 16

-- The prefix records in ARGV[at ..], checked for record_prefix (below), or
-- nil and an error reply. ARGV[at] = r, then r records, each: '<id>#<epoch>' (an
-- instance id, its epoch as the node's view has it), max_owners (instances kept per
-- block, 1..64), k (1..512), then k pairs {block hash (1..64 chars of [0-9a-f]),
-- weight (the blocks it adds, 0..512; 0 = a refresh of a block the instance holds)},
-- in prompt order, the last one the prompt's last block. They need KEYS[18] =
-- {pool}:prefix_index, and must be the last arguments.
local function carried_records(at)
  local r = int_arg(ARGV[at], MAX_RECORDS)
  if r == nil then return nil, fail('bad_arg', 'records: expected r in 0..16') end
  if r > 0 and not KEYS[18] then
    return nil, fail('bad_arg', 'records need KEYS[18], the prefix index')
  end
  local records, i = {}, at + 1
  for j = 1, r do
    local stem = ARGV[i]
    local id, epoch = string.match(stem or '', '^(.+)#(%d+)$')
    if not id or not valid_id(id) then
      return nil, fail('bad_arg', 'record ' .. j .. ': expected <id>#<epoch>')
    end
    local max_owners = int_arg(ARGV[i + 1], 64)
    if max_owners == nil or max_owners < 1 then
      return nil, fail('bad_arg', 'record ' .. j .. ': max_owners in 1..64')
    end
    local k = int_arg(ARGV[i + 2], 512)
    if k == nil or k < 1 or #ARGV < i + 2 + 2 * k then
      return nil, fail('bad_arg', 'record ' .. j .. ': 1..512 pairs of block hash and weight')
    end
    local fields, weights, added = {stem}, {}, 0  -- the count, then the blocks
    for p = 1, k do
      local hash = ARGV[i + 1 + 2 * p]
      if #hash < 1 or #hash > 64 then
        return nil, fail('bad_arg', 'record ' .. j .. ': block hash ' .. p)
      end
      fields[p + 1] = hash
      weights[p] = int_arg(ARGV[i + 2 + 2 * p], 512)
      if weights[p] == nil then return nil, fail('bad_arg', 'record ' .. j .. ': weight ' .. p) end
      added = added + weights[p]
    end
    if not string.find(table.concat(fields, '', 2), '^[0-9a-f]*$') then  -- one match for all
      return nil, fail('bad_arg', 'record ' .. j .. ': block hashes are [0-9a-f]+')
    end
    records[j] = {id = id, epoch = epoch, stem = stem, max_owners = max_owners,
      fields = fields, weights = weights, added = added}
    i = i + 3 + 2 * k
  end
  if i ~= #ARGV + 1 then return nil, fail('bad_arg', 'records: arguments left over') end
  return records
end

-- The number of transitions in ARGV[from ..] (ARGV[from] = m, then m pairs
-- {'f' (first token) | 'r' (release), rid}), and the prefix records after them (none
-- when the arguments end there; carried_records); or nil and an error reply.
local function carried_count(from)
  local m = int_arg(ARGV[from], MAX_CARRIED)
  if m == nil or #ARGV < from + 2 * m then
    return nil, fail('bad_arg', 'transitions: expected m >= 0 pairs of {op, rid}')
  end
  for i = 1, m do
    local op, rid = ARGV[from + 2 * i - 1], ARGV[from + 2 * i]
    if (op ~= 'f' and op ~= 'r') or not valid_id(rid) then
      return nil, fail('bad_arg', 'transition ' .. i)
    end
  end
  if #ARGV == from + 2 * m then return m, {} end
  local records, err = carried_records(from + 2 * m + 1)
  if not records then return nil, err end
  return m, records
end

-- Record a routed request's prefix blocks against the chosen instance, in the prefix
-- index (coordinator/prefix_entries.py says its format and what it means): the
-- instance's count grows by the blocks the record adds, which gives its entries their
-- positions, deepest first; each block's owners get this instance's entry as the
-- newest (its older one, of any epoch, replaced; anything in the value that is no
-- entry dropped) and keep at most `max_owners`. The deepest pair is the prompt's last
-- block; every other entry ends in `inside`, '+' and the Redis time in seconds (the
-- prompt went on past the block then: another prompt credited there soon after shares
-- a prefix with it, and is not its next turn). One HMGET and one HSET, the fewest
-- strings in and out of Lua: this runs once per request. Returns the instance's count
-- after the record.
local function record_prefix(index, rec, inside)
  local unpack = table.unpack or unpack
  local fields, weights, n = rec.fields, rec.weights, #rec.weights
  local got = redis.call('HMGET', index, unpack(fields))
  -- a count that is no number (a hand edit, say) starts again: a missed credit
  local count = (tonumber(got[1]) or 0) + rec.added
  local mine, stem = rec.id .. '#', rec.stem
  local sets = {stem, count, mine, rec.epoch}
  local position = count - rec.added
  for i = n, 1, -1 do  -- deepest first
    position = position + weights[i]
    local kept, list = '', got[i + 1]
    if list then
      local others, k = {}, 0
      for text in string.gmatch(list, '%S+') do
        -- another instance's entry (anything else in the value is dropped)
        if string.sub(text, 1, #mine) ~= mine and (string.find(text, '^[^#|]+#%d+|%d+$')
            or string.find(text, '^[^#|]+#%d+|%d+%+%d+$')) then
          k = k + 1
          others[k] = text
        end
      end
      local first = math.max(1, k - rec.max_owners + 2)  -- room for this entry
      if first <= k then kept = table.concat(others, ' ', first) .. ' ' end
    end
    sets[#sets + 1] = fields[i + 1]
    sets[#sets + 1] = kept .. stem .. '|' .. position .. (i < n and inside or '')
  end
  redis.call('HSET', index, unpack(sets))
  return count
end

-- Apply the m transitions carried_count checked, in order, then its prefix records.
-- Returns their replies, one flat list: 4 items per transition, {status, state_ver,
-- slot, record} (state_ver -1 when no counter moved), then each record's count; and
-- how many changes of `state` the transitions made.
local function apply_carried(from, m, records, rids_key, now)
  local out, bumps = {}, 0
  for i = 1, m do
    local op, rid = ARGV[from + 2 * i - 1], ARGV[from + 2 * i]
    local status, patch
    if op == 'f' then
      status, patch = first_token(rid, now)
    else
      status, patch = release_one(rid, rids_key, now)
    end
    if patch then bumps = bumps + 1 else patch = {-1, -1, ''} end
    table.insert(out, status)
    table.insert(out, patch[1])
    table.insert(out, patch[2])
    table.insert(out, patch[3])
  end
  if #records > 0 then
    local inside = '+' .. math.floor(now / 1000)  -- the suffix of entries inside a prompt
    for j = 1, #records do table.insert(out, record_prefix(KEYS[18], records[j], inside)) end
  end
  return out, bumps
end
