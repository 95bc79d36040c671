-- read_outliers: the pool's passive-health state, with the Redis time to judge it by.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:outliers  (see record_outcome.lua)
-- returns {now_ms, {field, value, field, value, ...}} (fields "<id>:<name>")
-- HSCAN, not HGETALL: the documented ACL (docs/security.md) allows only the former.
local out, cursor = {}, '0'
repeat
  local page = redis.call('HSCAN', KEYS[17], cursor, 'COUNT', 1000)
  cursor = page[1]
  for _, v in ipairs(page[2]) do out[#out + 1] = v end
until cursor == '0'
return {now_ms(), out}
