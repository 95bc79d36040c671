-- release: end a reservation and drop its counters (idempotent by rid).
-- KEYS[1..21] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[22] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid
-- returns {'ok'|'noop'}   noop: the rid is unknown (released or reaped)
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local now = now_ms()
redis.call('SREM', KEYS[22], ARGV[1])
local raw = redis.call('HGET', K_RES, ARGV[1])
if not raw then return {'noop'} end
drop_reservation(ARGV[1], cjson.decode(raw), now)
return {'ok'}
