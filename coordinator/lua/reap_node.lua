-- reap_node: release every reservation of a node whose lease has expired.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the dead node's reservation set
-- ARGV[1] = the dead node's id
-- returns {'reaped', n} | {'alive', 0} when the lease was renewed meanwhile
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
local now = now_ms()
local deadline = redis.call('ZSCORE', K_NODES, ARGV[1])
if deadline and tonumber(deadline) >= now then return {'alive', 0} end
local reaped = 0
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[17])) do
  local raw = redis.call('HGET', K_RES, rid)
  if raw then
    local rec = cjson.decode(raw)
    if rec.node == ARGV[1] then
      drop_reservation(rid, rec, now)
      reaped = reaped + 1
    end
  end
end
redis.call('DEL', KEYS[17])
redis.call('ZREM', K_NODES, ARGV[1])
return {'reaped', reaped}
