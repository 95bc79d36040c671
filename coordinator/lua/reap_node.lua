-- reap_node: release the reservations of a node whose lease has expired, in bounded
-- steps: the caller repeats the call until it answers 'reaped'.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the dead node's reservation set
-- ARGV[1] = the dead node's id
-- ARGV[2] = force: '1' reaps even a live lease (a node restarting under its old id
--           reaps its predecessor's reservations before taking the lease)
-- ARGV[3] = budget: reservations to release in this step (1..5000; default 250; the
--   node asks for 25, which keeps a step below 5 ms on a 10,000-instance pool even
--   when the server runs at half speed: 50 took 5.7 ms on a slow spell of a 2-core VM)
-- returns {'reaped', n}   every reservation released and the lease removed
--       | {'more', n}     n released; more remain (call again)
--       | {'alive', 0}    the lease was renewed meanwhile
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
if ARGV[2] ~= nil and ARGV[2] ~= '0' and ARGV[2] ~= '1' then return fail('bad_arg', 'force') end
local budget = SWEEP_BUDGET
if ARGV[3] ~= nil then budget = int_arg(ARGV[3], 5000) end
if budget == nil or budget < 1 then return fail('bad_arg', 'budget') end
local now = now_ms()
local deadline = redis.call('ZSCORE', K_NODES, ARGV[1])
if ARGV[2] ~= '1' and deadline and tonumber(deadline) >= now then return {'alive', 0} end
local reaped, touched = 0, {}
local rids = redis.call('SPOP', KEYS[17], budget)
for _, rid in ipairs(rids) do
  local raw = redis.call('HGET', K_RES, rid)
  if raw then
    local rec = cjson.decode(raw)
    if rec.node == ARGV[1] then
      drop_reservation(rid, rec, now, touched)
      reaped = reaped + 1
    end
  end
end
sync_touched(touched)
commit_state()
if redis.call('SCARD', KEYS[17]) > 0 then return {'more', reaped} end
redis.call('ZREM', K_NODES, ARGV[1])
return {'reaped', reaped}
