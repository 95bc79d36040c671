-- mark_first_token: move a reservation from prefill to decode (idempotent by rid).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = rid
-- returns {'ok', state_ver, slot, record} | {'ok'} | {'noop'}
--   state_ver, slot, record: this call's change of `state` (the caller applies it
--     when its view is at state_ver - 1); {'ok'} alone when no counter moved (the
--     instance restarted or left since the reservation)
--   noop: unknown rid, or already in decode
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local reply = transition_reply(first_token(ARGV[1], now_ms()))
commit_state()
return reply
