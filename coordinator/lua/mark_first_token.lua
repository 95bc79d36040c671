-- mark_first_token: move a reservation from prefill to decode (idempotent by rid).
-- KEYS[1..21] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = rid
-- returns {'ok', state_ver, slot, record} | {'ok'} | {'noop'}
--   state_ver, slot, record: this call's change of `state` (the caller applies it
--     when its view is at state_ver - 1); {'ok'} alone when no counter moved (the
--     instance restarted or left since the reservation)
--   noop: unknown rid, or already in decode
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local now = now_ms()
local raw = redis.call('HGET', K_RES, ARGV[1])
if not raw then return {'noop'} end
local rec = cjson.decode(raw)
if rec.phase ~= 'prefill' then return {'noop'} end
local id = rec.instance
redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.epoch, rec.end_at_ms, ARGV[1]))
rec.phase = 'decode'
rec.first_token_at_ms = now
rec.end_at_ms = now + rec.decode_ms
redis.call('HSET', K_RES, ARGV[1], encode_record(rec))
redis.call('ZADD', K_BY_INSTANCE, 0, lex_member(id, rec.epoch, rec.end_at_ms, ARGV[1]))
if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') ~= rec.epoch then return {'ok'} end
local pending = add(K_PENDING, id, -1)
local decode = redis.call('HINCRBY', K_DECODE, id, 1)
local free = rechain_after_first_token(id, now, add(K_PENDING_MS, id, 0 - rec.prefill_ms))
local patch = publish_state(id, rec.epoch, pending, decode, free)
if not patch then return {'ok'} end
return {'ok', patch[1], patch[2], patch[3]}
