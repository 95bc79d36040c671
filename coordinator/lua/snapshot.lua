-- snapshot: the pool's instance rows changed since a version, in one round trip.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- ARGV[1] = since: the pool version the caller last saw (0 = full read)
-- ARGV[2] = run_id the caller last saw ('' = none)
-- returns {run_id, pool_version, now_ms, full(0/1), rows} (rows: see _lib.lua row())
local since = int_arg(ARGV[1])
if since == nil then return fail('bad_arg', 'since must be a non-negative integer') end
return delta(since, ARGV[2] or '', now_ms())
