-- read_state: the pool's packed per-instance state in one round trip.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = '1' to include the liveness records (last_seen, hints), '0' not to
-- returns {run_id, spec_gen, now_ms, state, live|false, state_ver, nodes}
--   state/live: packed records by slot (see _lib.lua; coordinator/packed.py);
--   spec_gen: when it differs from the caller's, read_specs tells what changed;
--   state_ver: the version of `state` (meta state_ver; see write_state in _lib.lua);
--   nodes: the nodes holding a lease now (a node re-reads the whole state less often
--   in a larger fleet: Settings.snapshot_nodes)
if ARGV[1] ~= '0' and ARGV[1] ~= '1' then return fail('bad_arg', 'live must be 0 or 1') end
local now = now_ms()
local run = run_id(now)
local live = false
if ARGV[1] == '1' then live = redis.call('GET', K_LIVE) or '' end
return {run, num(K_META, 'spec_gen'), now, redis.call('GET', K_STATE) or '', live,
  num(K_META, 'state_ver'), redis.call('ZCOUNT', K_NODES, now, '+inf')}
