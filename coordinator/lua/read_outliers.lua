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
local out, epochs = {}, {}
local page = redis.call('HSCAN', KEYS[17], cursor, 'COUNT', 256)
local flat = page[2]
for i = 1, #flat, 2 do
  local id = string.match(flat[i], '^(.*):[%w_]+$')
  if id and epochs[id] == nil then
    local current = redis.call('HGET', K_EPOCH, id)
    epochs[id] = current ~= false
      and current == redis.call('HGET', KEYS[17], id .. ':epoch')
  end
  if id and epochs[id] then
    out[#out + 1] = flat[i]
    out[#out + 1] = flat[i + 1]
  end
end
return {now_ms(), out, page[1]}
