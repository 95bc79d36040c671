-- unregister: remove an instance and void its reservations.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- ARGV[1] = instance id
-- returns {'ok', voided_reservations}
-- errors: LCERR unknown_instance when the id is not registered
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
if not redis.call('HGET', K_EPOCH, id) then return fail('unknown_instance', id) end
local now = now_ms()
local voided = void_instance(id)
-- The per-instance version stays: it must keep rising if the id registers again.
for _, key in ipairs({K_SPEC, K_EPOCH, K_LAST_SEEN, K_MAX_SLOTS, K_INFLIGHT, K_PENDING,
    K_DECODE, K_PENDING_MS, K_PREFILL_FREE}) do
  redis.call('HDEL', key, id)
end
for _, name in ipairs(HINTS) do
  redis.call('HDEL', K_HINTS, id .. ':' .. name, id .. ':' .. name .. '_at_ms')
end
-- The changes entry stays as a tombstone so incremental readers drop the row.
touch(id, now)
return {'ok', voided}
