-- read_state: the head of the pool's view; the node reads `state` (and `live`) by
-- GET in the same MULTI/EXEC (coordinator.py _read_state): as atomic as one script,
-- without copying the strings through Lua (a GET of 24 KB inside a script costs the
-- server about 15x the instructions of the same GET sent directly).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV: none
-- returns {run_id, spec_gen, now_ms, false, false, state_ver, nodes}: a view without
--   its state and live strings (the GETs after it fill them in);
--   spec_gen: when it differs from the caller's, read_specs tells what changed;
--   state_ver: the version of `state` (meta state_ver; see write_state in _lib.lua);
--   nodes: the nodes holding a lease now (a node re-reads the whole state less often
--   in a larger fleet: Settings.snapshot_nodes)
local now = now_ms()
local run = run_id(now)
return {run, num(K_META, 'spec_gen'), now, false, false, num(K_META, 'state_ver'),
  redis.call('ZCOUNT', K_NODES, now, '+inf')}
