-- register: upsert an instance; a higher epoch voids the old epoch's reservations.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:prefix_index (coordinator/prefix_entries.py), to read the id's latest
--   epoch with index entries
-- ARGV[1] = instance id
-- ARGV[2] = spec JSON (InstanceSpec without epoch): an object with this id and an
--   http(s) url; its other fields are validated by the caller
-- ARGV[3] = max_slots (integer >= 0, 0 = unlimited)
-- ARGV[4] = epoch (integer >= 0; 0 = keep the stored epoch, or 1 when new: above the
--   epochs of a former registration that left void records or prefix entries)
-- returns {'new'|'updated'|'restarted', epoch, voided_reservations}
--   a restart zeroes the old epoch's counters at once; its records are deleted in
--   bounded steps (sweep.lua), never all in this call
-- errors: LCERR epoch_fenced when ARGV[4] is below the stored epoch
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
-- Checked here too: one undecodable spec would break every node's snapshot.
local decoded, spec = pcall(cjson.decode, ARGV[2] or '')
if not decoded or type(spec) ~= 'table' or spec.id ~= id or type(spec.url) ~= 'string'
    or not string.find(spec.url, '^https?://') then
  return fail('bad_arg', 'spec must be a JSON object with this id and an http(s) url')
end
local max_slots = int_arg(ARGV[3], 1000000)
if max_slots == nil then return fail('bad_arg', 'max_slots must be an integer >= 0') end
local epoch = int_arg(ARGV[4])
if epoch == nil then return fail('bad_arg', 'epoch must be an integer >= 0') end
local now = now_ms()
local stored = redis.call('HGET', K_EPOCH, id)
local status, voided = 'updated', 0
if not stored then
  status = 'new'
  -- An id unregistered while void records of it remain continues above their epoch.
  local retired = tonumber(redis.call('HGET', K_RETIRED, id) or '0')
  if epoch == 0 then
    -- An automatic epoch also continues above the latest epoch the prefix index holds
    -- entries of (they outlive the id's reservation records): at that epoch again,
    -- they would credit a cache this engine may not hold. An explicit epoch names its
    -- engine: equal to theirs, it is the engine that holds them.
    local indexed = tonumber(redis.call('HGET', KEYS[17], id .. '#'))
    if indexed then retired = math.max(retired, indexed) end
  end
  if epoch <= retired then epoch = retired + 1 end
else
  stored = tonumber(stored)
  if epoch == 0 or epoch == stored then
    epoch = stored
  elseif epoch < stored then
    return fail('epoch_fenced', id .. ' has epoch ' .. stored .. ', got ' .. epoch)
  else
    status = 'restarted'
    voided = void_instance(id, now)
  end
end
redis.call('HSET', K_SPEC, id, ARGV[2])
redis.call('HSET', K_EPOCH, id, string.format('%d', epoch))
redis.call('HSET', K_MAX_SLOTS, id, max_slots)
redis.call('HSET', K_LAST_SEEN, id, string.format('%d', now))
alloc_slot(id)
if status == 'new' then
  -- A fresh record: a freed slot was zeroed, one past the end of `state` reads as zeros.
  local st = slot_state(id)
  st.free_at = now
  write_state(st)
end
commit_state()
sync_live(id)
spec_changed(id, now)
sweep(SWEEP_BUDGET)
return {status, epoch, voided}
