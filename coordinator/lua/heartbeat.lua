-- heartbeat: refresh an instance's liveness and store the engine hints it carries.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = instance id
-- ARGV[2] = engine_running (number >= 0, or '' when not reported)
-- ARGV[3] = engine_waiting (number >= 0, or '')
-- ARGV[4] = queue_depth (number >= 0, or '')
-- returns {'ok', epoch}
-- errors: LCERR unknown_instance when the id is not registered (re-register)
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local bad = bad_hint_args()
if bad then return bad end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return fail('unknown_instance', id) end
local now = now_ms()
redis.call('HSET', K_LAST_SEEN, id, string.format('%d', now))
store_hint_args(id, now)
sync_live(id)
return {'ok', tonumber(epoch)}
