-- release: end a reservation and drop its counters (idempotent by rid).
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid
-- ARGV[2] = since: pool version for the piggybacked delta
-- ARGV[3] = run_id the caller last saw
-- returns {'ok'|'noop', delta}   noop: the rid is unknown (released or reaped)
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local since = int_arg(ARGV[2])
if since == nil then return fail('bad_arg', 'since') end
local now = now_ms()
redis.call('SREM', KEYS[17], ARGV[1])
local raw = redis.call('HGET', K_RES, ARGV[1])
if not raw then return {'noop', delta(since, ARGV[3], now)} end
drop_reservation(ARGV[1], cjson.decode(raw), now)
return {'ok', delta(since, ARGV[3], now)}
