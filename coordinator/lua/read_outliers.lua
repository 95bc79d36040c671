-- read_outliers: one page of the pool's passive-health state, with the Redis time to
-- judge it by. In pages, as read_specs reads specs: a pool where many instances have
-- failed holds a record for each, and one call reading them all would stall the shard
-- (10,000 records took 58 ms).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:outliers  (see record_outcome.lua)
-- ARGV[1] (optional) = HSCAN cursor of the page to read ('0' or absent: the first)
-- returns {now_ms, {field, value, field, value, ...}, next_cursor} (fields
--   "<id>:<name>", about 256 a page; next_cursor '0' when the hash was read to its
--   end), leaving out the records of instances that re-registered with another epoch
--   since, or left
-- HSCAN, not HGETALL: the documented ACL (docs/security.md) allows only the former.
local cursor = ARGV[1] or '0'
if cursor == '' or not valid_cursor(cursor) then
  return fail('bad_arg', 'cursor must be an HSCAN cursor')
end
local page = redis.call('HSCAN', KEYS[17], cursor, 'COUNT', 256)
local flat = page[2]
-- Each instance on the page once, then its current and recorded epochs in two HMGETs
-- (not two HGETs an instance: a page holds about 64 of them).
local ids, at, owner = {}, {}, {}
for i = 1, #flat, 2 do
  local id = string.match(flat[i], '^(.*):[%w_]+$')
  owner[i] = id
  if id and at[id] == nil then
    ids[#ids + 1] = id
    at[id] = #ids
  end
end
local current = {}
if #ids > 0 then
  local recorded = {}
  for k, id in ipairs(ids) do recorded[k] = id .. ':epoch' end
  local now_epochs = redis.call('HMGET', K_EPOCH, unpack(ids))
  local kept_epochs = redis.call('HMGET', KEYS[17], unpack(recorded))
  for k = 1, #ids do
    current[k] = now_epochs[k] ~= false and now_epochs[k] == kept_epochs[k]
  end
end
local out = {}
for i = 1, #flat, 2 do
  local id = owner[i]
  if id and current[at[id]] then
    out[#out + 1] = flat[i]
    out[#out + 1] = flat[i + 1]
  end
end
return {now_ms(), out, page[1]}
