-- unregister: remove an instance and void its reservations.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:outliers, KEYS[18] = {pool}:ejected (record_outcome.lua): the
--   instance's passive-health record and cordon go with it (an id registered again
--   later, even at the same epoch, starts clean and in rotation)
-- ARGV[1] = instance id
-- returns {'ok', voided_reservations}
--   the records are deleted in bounded steps (sweep.lua), never all in this call
-- errors: LCERR unknown_instance when the id is not registered
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return fail('unknown_instance', id) end
local now = now_ms()
local st = slot_state(id)
local voided = st and st.base or 0
redis.call('SADD', K_VOIDS, id)
-- Re-registering the id continues above this epoch while void records remain.
redis.call('HSET', K_RETIRED, id, epoch)
free_slot(id)
commit_state()
for _, key in ipairs({K_SPEC, K_EPOCH, K_LAST_SEEN, K_MAX_SLOTS}) do
  redis.call('HDEL', key, id)
end
for _, name in ipairs(HINTS) do
  redis.call('HDEL', K_HINTS, id .. ':' .. name, id .. ':' .. name .. '_at_ms')
end
local outlier = {}
for i, name in ipairs({'fails', 'last_fail_ms', 'until_ms', 'ejections', 'reason', 'cordon',
    'epoch'}) do
  outlier[i] = id .. ':' .. name
end
redis.call('HDEL', KEYS[17], unpack(outlier))
redis.call('ZREM', KEYS[18], id)
spec_changed(id, now)
sweep(SWEEP_BUDGET)
return {'ok', voided}
