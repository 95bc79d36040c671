-- Shared prelude, prepended to every script by coordinator/scripts.py.
-- KEYS[1..16] are the pool columns in coordinator/keys.py COLUMNS order; every
-- script receives all of them, plus script-specific keys from KEYS[17] on.
-- Times are the Redis server clock in ms. Errors are "LCERR <kind> <detail>".

local K_META, K_CHANGES, K_SPEC, K_EPOCH = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_LAST_SEEN, K_MAX_SLOTS, K_INFLIGHT = KEYS[5], KEYS[6], KEYS[7]
local K_PENDING, K_DECODE, K_PENDING_MS = KEYS[8], KEYS[9], KEYS[10]
local K_PREFILL_FREE, K_VERSION, K_HINTS = KEYS[11], KEYS[12], KEYS[13]
local K_RES, K_BY_INSTANCE, K_NODES = KEYS[14], KEYS[15], KEYS[16]
local HINTS = {'engine_running', 'engine_waiting', 'queue_depth'}

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

local function num(key, id)
  return tonumber(redis.call('HGET', key, id) or '0')
end

-- Ensure the pool's meta hash exists; run_id changes when Redis lost the pool.
local function run_id(now)
  local id = redis.call('HGET', K_META, 'run_id')
  if not id then
    id = string.format('%d-%d', now, math.random(1, 1000000000))
    redis.call('HSET', K_META, 'run_id', id, 'created_ms', string.format('%d', now), 'version', 0)
  end
  return id
end

-- Record a change of instance `id`: bumps its version and the pool version.
local function touch(id, now)
  run_id(now)
  local v = redis.call('HINCRBY', K_META, 'version', 1)
  redis.call('HINCRBY', K_VERSION, id, 1)
  redis.call('ZADD', K_CHANGES, v, id)
end

local function lex_member(id, end_at, rid)
  return id .. '|' .. string.format('%015d', end_at) .. '|' .. rid
end

-- Longest predicted prefill or decode time (ms): one day. Callers clamp predictions
-- to it (coordinator/models.py MAX_PREDICTED_MS), so a valid request always fits.
local MAX_PREDICTED_MS = 86400000

-- pending_prefill_ms of an instance, never below 0 (written back clamped).
local function pending_prefill_ms(id)
  local pending_ms = num(K_PENDING_MS, id)
  if pending_ms < 0 then
    pending_ms = 0
    redis.call('HSET', K_PENDING_MS, id, '0')
  end
  return pending_ms
end

-- Re-chain the serialized prefill cursor after a reservation's first token: its
-- prefill just ended, so the prefills queued behind it start now, one after another.
local function rechain_after_first_token(id, now)
  redis.call('HSET', K_PREFILL_FREE, id, string.format('%d', now + pending_prefill_ms(id)))
end

-- Re-chain the cursor after prefill reservation `rec` left before its first token
-- (release, reap). Prefill is serialized FCFS (local_fleet/engine_model.py):
-- - its prefill had not started (predicted start after now): only its share leaves
--   the chain; the prefill in progress keeps the progress it made, so the cursor
--   moves back by exactly its prefill_ms;
-- - its prefill had started: the engine finishes that iteration anyway, so the
--   cursor stays, but never below now + the prefill work still queued.
local function rechain_after_cancel(id, rec, now)
  local pending_ms = pending_prefill_ms(id)
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
end

-- Whether `node` holds a lease now (its deadline has not passed).
local function lease_held(node, now)
  local deadline = redis.call('ZSCORE', K_NODES, node)
  return deadline ~= false and deadline ~= nil and tonumber(deadline) >= now
end

-- Remove one reservation and its counters. `rec` is the decoded record.
local function drop_reservation(rid, rec, now)
  local id = rec.instance
  redis.call('HDEL', K_RES, rid)
  redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.end_at_ms, rid))
  if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then
    return  -- the instance restarted or left: its counters were reset then
  end
  if num(K_INFLIGHT, id) > 0 then redis.call('HINCRBY', K_INFLIGHT, id, -1) end
  if rec.phase == 'prefill' then
    if num(K_PENDING, id) > 0 then redis.call('HINCRBY', K_PENDING, id, -1) end
    redis.call('HINCRBY', K_PENDING_MS, id, 0 - rec.prefill_ms)  -- never '-0': Redis rejects it
    rechain_after_cancel(id, rec, now)
  else
    if num(K_DECODE, id) > 0 then redis.call('HINCRBY', K_DECODE, id, -1) end
  end
  touch(id, now)
end

-- Drop every reservation of an instance (epoch bump or unregister); returns count.
local function void_instance(id)
  local members = redis.call('ZRANGEBYLEX', K_BY_INSTANCE, '[' .. id .. '|', '(' .. id .. '}')
  for _, member in ipairs(members) do
    local rid = string.match(member, '^.-|%d+|(.*)$')
    redis.call('HDEL', K_RES, rid)
    redis.call('ZREM', K_BY_INSTANCE, member)
  end
  for _, key in ipairs({K_INFLIGHT, K_PENDING, K_DECODE, K_PENDING_MS}) do
    redis.call('HSET', key, id, 0)
  end
  return #members
end

local function earliest_end(id)
  local first = redis.call('ZRANGEBYLEX', K_BY_INSTANCE, '[' .. id .. '|', '(' .. id .. '}',
    'LIMIT', 0, 1)
  if #first == 0 then return -1 end
  return tonumber(string.match(first[1], '^.-|(%d+)|'))
end

-- One instance row: {id, spec_json|false, epoch, last_seen, max_slots, inflight,
-- pending_prefill, active_decode, prefill_free_at, earliest_end|-1, version,
-- hint_name, value, at_ms, ...}. A removed instance is {id, false, version}.
local function row(id)
  local spec = redis.call('HGET', K_SPEC, id)
  if not spec then return {id, false, num(K_VERSION, id)} end
  local r = {id, spec, num(K_EPOCH, id), num(K_LAST_SEEN, id), num(K_MAX_SLOTS, id),
    num(K_INFLIGHT, id), num(K_PENDING, id), num(K_DECODE, id), num(K_PREFILL_FREE, id),
    earliest_end(id), num(K_VERSION, id)}
  for _, name in ipairs(HINTS) do
    local at = redis.call('HGET', K_HINTS, id .. ':' .. name .. '_at_ms')
    if at then
      table.insert(r, name)
      table.insert(r, redis.call('HGET', K_HINTS, id .. ':' .. name))
      table.insert(r, at)
    end
  end
  return r
end

-- Rows changed since `since` under run `seen_run`; a full read when the run
-- differs (Redis lost the pool) or `since` is 0. Returns
-- {run_id, pool_version, now, full(0/1), rows}.
local function delta(since, seen_run, now)
  local run = run_id(now)
  local version = tonumber(redis.call('HGET', K_META, 'version'))
  local full = (since == 0 or seen_run ~= run or since > version)
  local ids
  if full then
    ids = redis.call('ZRANGE', K_CHANGES, 0, -1)
  else
    ids = redis.call('ZRANGEBYSCORE', K_CHANGES, '(' .. since, '+inf')
  end
  local rows = {}
  for _, id in ipairs(ids) do
    local r = row(id)
    if r[2] or not full then table.insert(rows, r) end
  end
  return {run, version, now, full and 1 or 0, rows}
end
