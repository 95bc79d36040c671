-- reap_node: release every reservation of a node whose lease has expired.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the dead node's reservation set
-- ARGV[1] = the dead node's id
-- ARGV[2] = force: '1' reaps even a live lease (a node restarting under its old id
--           reaps its predecessor's reservations before taking the lease)
-- returns {'reaped', n} | {'alive', 0} when the lease was renewed meanwhile
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
if ARGV[2] ~= nil and ARGV[2] ~= '0' and ARGV[2] ~= '1' then return fail('bad_arg', 'force') end
local now = now_ms()
local deadline = redis.call('ZSCORE', K_NODES, ARGV[1])
if ARGV[2] ~= '1' and deadline and tonumber(deadline) >= now then return {'alive', 0} end
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
