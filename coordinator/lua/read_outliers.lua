-- read_outliers: the pool's passive-health state, with the Redis time to judge it by.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:outliers  (see record_outcome.lua)
-- returns {now_ms, {field, value, field, value, ...}} (fields "<id>:<name>"), leaving
--   out the records of instances that re-registered with another epoch since, or left
-- HSCAN, not HGETALL: the documented ACL (docs/security.md) allows only the former.
local out, cursor, epochs = {}, '0', {}
repeat
  local page = redis.call('HSCAN', KEYS[17], cursor, 'COUNT', 1000)
  cursor = page[1]
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
until cursor == '0'
return {now_ms(), out}
