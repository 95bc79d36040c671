-- reserve: claim the first ranked candidate whose version is unchanged.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid (request id, [A-Za-z0-9._:-], <= 128 chars)
-- ARGV[2] = node id
-- ARGV[3] = prompt_tokens (integer >= 0)
-- ARGV[4] = expected_output_tokens (integer >= 0)
-- ARGV[5] = force (1 = ignore versions: take the least-reserved alive candidate)
-- ARGV[6] = enforce_slots (1 = skip candidates at max_slots)
-- ARGV[7] = instance ttl in ms (alive while now - last_seen <= ttl)
-- ARGV[8] = since: pool version for the piggybacked delta
-- ARGV[9] = run_id the caller last saw
-- ARGV[10] = lease_ms: 0 when the node believes it holds a lease (it must: a node
--   whose lease expired may have been reaped and must re-assert first); > 0 when the
--   node never held one: a missing lease is then created with this length (ms)
-- ARGV[11] = n, the number of candidates; then n groups of
--   {instance id, observed version, prefill_ms (ms, <= 86400000),
--    decode_ms (ms, <= 86400000), observed inflight, observed pending_prefill}
-- returns {'ok'|'dup', instance, epoch, predicted_ttft_ms, prefill_ms, decode_ms, delta}
--       | {'nolease', delta}          ARGV[10] = 0 and the node's lease is gone
--       | {'stale', delta}            every candidate changed since it was observed
--       | {'full', next_slot_in_ms, delta}  every alive candidate is at max_slots
--       | {'none', delta}             no candidate is registered and alive
local rid, node = ARGV[1], ARGV[2]
if not valid_id(rid) then return fail('bad_arg', 'rid') end
if not valid_id(node) then return fail('bad_arg', 'node') end
local prompt = int_arg(ARGV[3], 10000000)
if prompt == nil then return fail('bad_arg', 'prompt_tokens must be an integer >= 0') end
local expected = int_arg(ARGV[4], 10000000)
if expected == nil then return fail('bad_arg', 'expected_output_tokens must be an integer >= 0') end
local force, enforce = ARGV[5] == '1', ARGV[6] == '1'
local ttl = int_arg(ARGV[7])
if ttl == nil then return fail('bad_arg', 'ttl_ms') end
local since = int_arg(ARGV[8])
if since == nil then return fail('bad_arg', 'since') end
local lease_ms = int_arg(ARGV[10], 86400000)
if lease_ms == nil then return fail('bad_arg', 'lease_ms') end
local n = int_arg(ARGV[11], 64)
if n == nil or n < 1 or #ARGV ~= 11 + 6 * n then
  return fail('bad_arg', 'candidates: expected n >= 1 groups of 6')
end
local candidates = {}
for i = 1, n do
  local base = 11 + 6 * (i - 1)
  local c = {id = ARGV[base + 1], version = int_arg(ARGV[base + 2]),
    prefill_ms = int_arg(ARGV[base + 3], MAX_PREDICTED_MS),
    decode_ms = int_arg(ARGV[base + 4], MAX_PREDICTED_MS),
    inflight = int_arg(ARGV[base + 5]), pending = int_arg(ARGV[base + 6])}
  if not valid_id(c.id) or c.version == nil or c.prefill_ms == nil or c.decode_ms == nil
      or c.inflight == nil or c.pending == nil then
    return fail('bad_arg', 'candidate ' .. i)
  end
  candidates[i] = c
end

local now = now_ms()
-- Reservations are written only under a live lease: the reaper finds a node through
-- its lease, so a reservation without one would never go away.
local leased = lease_held(node, now)
if not leased and lease_ms == 0 then return {'nolease', delta(since, ARGV[9], now)} end
local existing = redis.call('HGET', K_RES, rid)
if existing then
  local rec = cjson.decode(existing)
  return {'dup', rec.instance, rec.epoch, rec.predicted_ttft_ms, rec.prefill_ms, rec.decode_ms,
    delta(since, ARGV[9], now)}
end

-- Unforced: the first alive candidate that is no busier than the caller saw it: its
-- version is unchanged, or only work left it (first tokens, releases). Forced (the
-- last try): the alive candidate with the fewest live reservations now, first on ties.
local saw_alive, saw_full, min_slot_ms = false, false, nil
local chosen, chosen_inflight = nil, nil
for _, c in ipairs(candidates) do
  local last_seen = redis.call('HGET', K_LAST_SEEN, c.id)
  if last_seen and now - tonumber(last_seen) <= ttl then
    saw_alive = true
    local max_slots = num(K_MAX_SLOTS, c.id)
    local inflight = num(K_INFLIGHT, c.id)
    if enforce and max_slots > 0 and inflight >= max_slots then
      saw_full = true
      local e = earliest_end(c.id)
      local wait = e >= 0 and math.max(0, e - now) or 0
      if min_slot_ms == nil or wait < min_slot_ms then min_slot_ms = wait end
    elseif force then
      if chosen == nil or inflight < chosen_inflight then chosen, chosen_inflight = c, inflight end
    elseif num(K_VERSION, c.id) == c.version
        or (inflight <= c.inflight and num(K_PENDING, c.id) <= c.pending) then
      chosen = c
      break
    end
  end
end

if not chosen then
  local d = delta(since, ARGV[9], now)
  if saw_full then return {'full', min_slot_ms or 0, d} end
  if saw_alive then return {'stale', d} end
  return {'none', d}
end

if not leased then redis.call('ZADD', K_NODES, now + lease_ms, node) end
local id = chosen.id
local epoch = num(K_EPOCH, id)
local start = math.max(now, num(K_PREFILL_FREE, id))
local first_token_at = start + chosen.prefill_ms
local end_at = first_token_at + chosen.decode_ms
local ttft = first_token_at - now
redis.call('HSET', K_PREFILL_FREE, id, string.format('%d', first_token_at))
redis.call('HINCRBY', K_INFLIGHT, id, 1)
redis.call('HINCRBY', K_PENDING, id, 1)
redis.call('HINCRBY', K_PENDING_MS, id, chosen.prefill_ms)
redis.call('HSET', K_RES, rid, cjson.encode({instance = id, epoch = epoch, node = node,
  phase = 'prefill', prompt_tokens = prompt, expected_output_tokens = expected,
  prefill_ms = chosen.prefill_ms, decode_ms = chosen.decode_ms, created_ms = now,
  first_token_at_ms = first_token_at, end_at_ms = end_at, predicted_ttft_ms = ttft}))
redis.call('ZADD', K_BY_INSTANCE, 0, lex_member(id, end_at, rid))
redis.call('SADD', KEYS[17], rid)
touch(id, now)
return {'ok', id, epoch, ttft, chosen.prefill_ms, chosen.decode_ms, delta(since, ARGV[9], now)}
