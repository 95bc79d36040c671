-- Shared prelude: coordinator/scripts.py prepends to each script the definitions
-- below that it uses (directly or through another one).
-- KEYS[1..21] are the pool keys in coordinator/keys.py COLUMNS order; every script
-- receives all of them, plus script-specific keys from KEYS[22] on.
-- Times are the Redis server clock in ms. Errors are "LCERR <kind> <detail>".

local K_META, K_SPEC_LOG, K_SPEC, K_EPOCH = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LAST_SEEN, K_MAX_SLOTS, K_INFLIGHT = KEYS[5], KEYS[6], KEYS[7]
local K_PENDING, K_DECODE, K_PENDING_MS = KEYS[8], KEYS[9], KEYS[10]
local K_PREFILL_FREE, K_SLOT, K_HINTS = KEYS[11], KEYS[12], KEYS[13]
local K_RES, K_BY_INSTANCE, K_NODES = KEYS[14], KEYS[15], KEYS[16]
local K_STATE, K_LIVE, K_FREE_SLOTS = KEYS[17], KEYS[18], KEYS[19]
local K_VOIDS, K_RETIRED = KEYS[20], KEYS[21]
local HINTS = {'engine_running', 'engine_waiting', 'queue_depth'}
-- Packed records (coordinator/packed.py decodes them), one per slot. A field is a
-- fixed number of base-128 digits, most significant first, each byte 0..127: plain
-- ASCII, so clients that decode replies as text read them unchanged.
-- state: pending_prefill, active_decode (3 digits each, saturating; inflight is their
--   sum), prefill_free_at_ms, earliest_end_at_ms (6 digits: ms to the year 2109;
--   0 = no live reservation)
-- live: last_seen_ms (6), then per hint: value*1000 (4, saturating), at_ms (6; 0 = none)
local STATE_BYTES, LIVE_BYTES = 18, 36
local SPEC_LOG_MAX = 10000  -- spec changes kept for incremental readers; older: full read
local SWEEP_BUDGET = 500  -- reservations one call may void; the rest is swept later

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function fail(kind, detail)
  return redis.error_reply('LCERR ' .. kind .. ' ' .. detail)
end

-- A non-negative integer argument, or nil when it is not one.
local function int_arg(value, max)
  local n = tonumber(value)
  if n == nil or n ~= n or n < 0 or n ~= math.floor(n) or n > (max or 1e15) then
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
  return id .. '#' .. string.format('%010d', epoch) .. '|' .. string.format('%015d', end_at)
    .. '|' .. rid
end

-- A reservation record as stored: JSON (cjson.decode reads it), formatted directly
-- at half the cost of cjson.encode. Ids are validated ids and phase is
-- 'prefill' or 'decode', so nothing needs escaping.
local RECORD_JSON = '{"instance":"%s","epoch":%d,"node":"%s","phase":"%s",'
  .. '"prompt_tokens":%d,"expected_output_tokens":%d,"prefill_ms":%d,"decode_ms":%d,'
  .. '"created_ms":%d,"first_token_at_ms":%d,"end_at_ms":%d,"predicted_ttft_ms":%d}'

local function encode_record(r)
  return string.format(RECORD_JSON, r.instance, r.epoch, r.node, r.phase, r.prompt_tokens,
    r.expected_output_tokens, r.prefill_ms, r.decode_ms, r.created_ms, r.first_token_at_ms,
    r.end_at_ms, r.predicted_ttft_ms)
end

local function epoch_range(id, epoch)
  local stem = id .. '#' .. string.format('%010d', epoch)
  return '[' .. stem .. '|', '(' .. stem .. '}'
end

-- Longest predicted prefill or decode time (ms): one day. Callers clamp predictions
-- to it (coordinator/models.py MAX_PREDICTED_MS), so a valid request always fits.
local MAX_PREDICTED_MS = 86400000

-- HINCRBY a counter by `by` and return it, never below 0 (written back clamped).
local function add(key, id, by)
  local v = redis.call('HINCRBY', key, id, by)
  if v < 0 then
    redis.call('HSET', key, id, '0')
    v = 0
  end
  return v
end

-- Re-chain the serialized prefill cursor after a reservation's first token: its
-- prefill just ended, so the prefills queued behind it start now, one after another.
-- `pending_ms` is the prefill work still queued. Returns the new cursor.
local function rechain_after_first_token(id, now, pending_ms)
  local free = now + pending_ms
  redis.call('HSET', K_PREFILL_FREE, id, string.format('%d', free))
  return free
end

-- Re-chain the cursor after prefill reservation `rec` left before its first token
-- (release, reap). Prefill is serialized FCFS (local_fleet/engine_model.py):
-- - its prefill had not started (predicted start after now): only its share leaves
--   the chain; the prefill in progress keeps the progress it made, so the cursor
--   moves back by exactly its prefill_ms;
-- - its prefill had started: the engine finishes that iteration anyway, so the
--   cursor stays, but never below now + the prefill work still queued (`pending_ms`).
-- Returns the new cursor.
local function rechain_after_cancel(id, rec, now, pending_ms)
  local cursor = num(K_PREFILL_FREE, id)
  local first_token_at = tonumber(rec.first_token_at_ms) or now
  local prefill_ms = tonumber(rec.prefill_ms) or 0
  local free
  if first_token_at - prefill_ms > now then
    free = math.max(now, cursor - prefill_ms)
  else
    free = math.max(cursor, now + pending_ms)
  end
  redis.call('HSET', K_PREFILL_FREE, id, string.format('%d', free))
  return free
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

-- Rewrite slot `slot` of `state`. Every change of `state` goes through here or
-- free_slot and bumps meta state_ver by one, so a node holding the version before
-- a change can apply that change's record alone. Returns {state_ver, slot, record}.
local function write_state(slot, pending, decode, free_at, earliest)
  local record = be3(pending) .. be3(decode) .. be6(free_at) .. be6(earliest)
  redis.call('SETRANGE', K_STATE, slot * STATE_BYTES, record)
  return {redis.call('HINCRBY', K_META, 'state_ver', 1), slot, record}
end

-- Rewrite instance `id`'s packed state record from the counters the caller just
-- wrote (no re-read); returns write_state's patch, or nil when `id` has no slot.
local function publish_state(id, epoch, pending, decode, free_at)
  local slot = redis.call('HGET', K_SLOT, id)
  if not slot then return nil end
  return write_state(tonumber(slot), pending, decode, free_at, earliest_end(id, epoch))
end

-- Rewrite instance `id`'s packed state record from its stored counters.
local function sync_state(id)
  return publish_state(id, num(K_EPOCH, id), num(K_PENDING, id), num(K_DECODE, id),
    num(K_PREFILL_FREE, id))
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

-- Return `id`'s slot to the free list, zeroing its records.
local function free_slot(id)
  local slot = redis.call('HGET', K_SLOT, id)
  if not slot then return end
  slot = tonumber(slot)
  redis.call('HDEL', K_SLOT, id)
  redis.call('SETRANGE', K_STATE, slot * STATE_BYTES, string.rep('\0', STATE_BYTES))
  redis.call('HINCRBY', K_META, 'state_ver', 1)
  redis.call('SETRANGE', K_LIVE, slot * LIVE_BYTES, string.rep('\0', LIVE_BYTES))
  redis.call('ZADD', K_FREE_SLOTS, slot, slot)
end

-- Remove one reservation and its counters. `rec` is the decoded record. With a
-- `touched` table, the instance's packed record is left for the caller to rewrite
-- once per instance (sync_touched), not once per reservation; without one, returns
-- the state patch (publish_state), or nil when no counter moved.
local function drop_reservation(rid, rec, now, touched)
  local id = rec.instance
  redis.call('HDEL', K_RES, rid)
  redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.epoch, rec.end_at_ms, rid))
  if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then
    return nil  -- the instance restarted or left: its counters were reset then
  end
  -- inflight counts both phases: the phase not released is the rest of it.
  local inflight = add(K_INFLIGHT, id, -1)
  local pending, decode, free
  if rec.phase == 'prefill' then
    pending = add(K_PENDING, id, -1)
    decode = inflight - pending
    free = rechain_after_cancel(id, rec, now, add(K_PENDING_MS, id, 0 - rec.prefill_ms))
  else
    decode = add(K_DECODE, id, -1)
    pending = inflight - decode
  end
  if touched then
    touched[id] = true
    return nil
  end
  return publish_state(id, rec.epoch, pending, decode, free or num(K_PREFILL_FREE, id))
end

local function sync_touched(touched)
  for id in pairs(touched) do sync_state(id) end
end

-- Void every reservation of `id` older than its current epoch (all of them once the
-- id is unregistered): counters restart at 0 now; the records themselves are
-- deleted in bounded steps (sweep), so one call never runs long.
local function void_instance(id)
  for _, key in ipairs({K_INFLIGHT, K_PENDING, K_DECODE, K_PENDING_MS}) do
    redis.call('HSET', key, id, 0)
  end
  redis.call('SADD', K_VOIDS, id)
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
  local id = rec.instance
  redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.epoch, rec.end_at_ms, rid))
  rec.phase = 'decode'
  rec.first_token_at_ms = now
  rec.end_at_ms = now + rec.decode_ms
  redis.call('HSET', K_RES, rid, encode_record(rec))
  redis.call('ZADD', K_BY_INSTANCE, 0, lex_member(id, rec.epoch, rec.end_at_ms, rid))
  if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then return 'ok' end
  local pending = add(K_PENDING, id, -1)
  local decode = redis.call('HINCRBY', K_DECODE, id, 1)
  local free = rechain_after_first_token(id, now, add(K_PENDING_MS, id, 0 - rec.prefill_ms))
  return 'ok', publish_state(id, rec.epoch, pending, decode, free)
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

-- The number of transitions in ARGV[from ..] (ARGV[from] = m, then m pairs
-- {'f' (first token) | 'r' (release), rid}), or nil and an error reply.
local function carried_count(from)
  local m = int_arg(ARGV[from], 10000)
  if m == nil or #ARGV ~= from + 2 * m then
    return nil, fail('bad_arg', 'transitions: expected m >= 0 pairs of {op, rid}')
  end
  for i = 1, m do
    local op, rid = ARGV[from + 2 * i - 1], ARGV[from + 2 * i]
    if (op ~= 'f' and op ~= 'r') or not valid_id(rid) then
      return nil, fail('bad_arg', 'transition ' .. i)
    end
  end
  return m
end

-- Apply the m transitions carried_count checked, in order. Returns their replies, one
-- flat list of 4 items each, {status, state_ver, slot, record} (state_ver -1 when no
-- counter moved), and how many changes of `state` they made.
local function apply_carried(from, m, rids_key, now)
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
  return out, bumps
end
