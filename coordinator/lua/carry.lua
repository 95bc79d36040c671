-- carry: first-token marks and releases a node held back (Coordinator.first_token_soon,
-- release_soon), and prefix records (PrefixIndex.record), that no reserve took along
-- within carry_ms, in one call.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- KEYS[18] = {pool}:prefix_index, when records are carried
-- ARGV[1] = m (<= 64), then m pairs {'f' (first token) | 'r' (release), rid}, applied in
--   order; then (optional) r and r prefix records (lua/_lib.lua carried_records)
-- returns the transitions' replies, 4 items each: {status ('ok'|'noop'), state_ver, slot,
--   record} (mark_first_token's and release's reply; state_ver -1 when no counter
--   moved), then each record's count (the instance's blocks in the index after it)
local m, records = carried_count(1)
if m == nil then return records end  -- the error reply
local out = apply_carried(1, m, records, KEYS[17], now_ms())
commit_state()
return out
