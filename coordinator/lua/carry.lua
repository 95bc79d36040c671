-- carry: first-token marks and releases a node held back (Coordinator.first_token_soon,
-- release_soon) and no reserve took along within carry_ms, in one call.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = m (<= 64), then m pairs {'f' (first token) | 'r' (release), rid}, applied in order
-- returns their replies, 4 items each: {status ('ok'|'noop'), state_ver, slot, record}
--   (mark_first_token's and release's reply; state_ver -1 when no counter moved)
local m, err = carried_count(1)
if m == nil then return err end
local out = apply_carried(1, m, KEYS[17], now_ms())
commit_state()
return out
