-- store_hints: store engine hints scraped by a node, without touching liveness.
-- A scrape proves that /metrics answers, not that the engine serves requests: only
-- the instance's own heartbeats (or a node's probe of a static instance) keep it alive.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = instance id
-- ARGV[2] = engine_running (number >= 0, or '' when not reported)
-- ARGV[3] = engine_waiting (number >= 0, or '')
-- ARGV[4] = queue_depth (number >= 0, or '')
-- returns {'ok', epoch}
-- errors: LCERR unknown_instance when the id is not registered
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local bad = bad_hint_args()
if bad then return bad end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return fail('unknown_instance', id) end
local now = now_ms()
store_hint_args(id, now)
sync_live(id)
return {'ok', tonumber(epoch)}
