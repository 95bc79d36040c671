-- release: end a reservation and drop its counters (idempotent by rid).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid
-- returns {'ok', state_ver, slot, record} | {'ok'} | {'noop'}
--   state_ver, slot, record: this call's change of `state` (the caller applies it
--     when its view is at state_ver - 1); {'ok'} alone when no counter moved
--   noop: the rid is unknown (released or reaped)
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local reply = transition_reply(release_one(ARGV[1], KEYS[17], now_ms()))
commit_state()
return reply
