-- unregister: remove an instance and void its reservations.
-- KEYS[1..21] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = instance id
-- returns {'ok', voided_reservations}
--   the records are deleted in bounded steps (sweep.lua), never all in this call
-- errors: LCERR unknown_instance when the id is not registered
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return fail('unknown_instance', id) end
local now = now_ms()
local voided = num(K_INFLIGHT, id)
void_instance(id)
-- Re-registering the id continues above this epoch while void records remain.
redis.call('HSET', K_RETIRED, id, epoch)
free_slot(id)
for _, key in ipairs({K_SPEC, K_EPOCH, K_LAST_SEEN, K_MAX_SLOTS, K_INFLIGHT, K_PENDING,
    K_DECODE, K_PENDING_MS, K_PREFILL_FREE}) do
  redis.call('HDEL', key, id)
end
for _, name in ipairs(HINTS) do
  redis.call('HDEL', K_HINTS, id .. ':' .. name, id .. ':' .. name .. '_at_ms')
end
spec_changed(id, now)
sweep(SWEEP_BUDGET)
return {'ok', voided}
