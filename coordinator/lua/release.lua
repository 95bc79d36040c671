-- release: end a reservation and drop its counters (idempotent by rid).
-- KEYS[1..21] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[22] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid
-- returns {'ok', state_ver, slot, record} | {'ok'} | {'noop'}
--   state_ver, slot, record: this call's change of `state` (the caller applies it
--     when its view is at state_ver - 1); {'ok'} alone when no counter moved
--   noop: the rid is unknown (released or reaped)
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local now = now_ms()
redis.call('SREM', KEYS[22], ARGV[1])
local raw = redis.call('HGET', K_RES, ARGV[1])
if not raw then return {'noop'} end
local patch = drop_reservation(ARGV[1], cjson.decode(raw), now)
if not patch then return {'ok'} end
return {'ok', patch[1], patch[2], patch[3]}
