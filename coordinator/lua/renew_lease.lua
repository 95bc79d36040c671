-- renew_lease: extend a node's lease and list the nodes whose lease expired.
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- ARGV[1] = node id
-- ARGV[2] = lease length in ms (integer > 0)
-- returns {deadline_ms, now_ms, expired_node_ids}
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
local lease = int_arg(ARGV[2], 86400000)
if lease == nil or lease < 1 then return fail('bad_arg', 'lease_ms must be an integer > 0') end
local now = now_ms()
run_id(now)
redis.call('ZADD', K_NODES, now + lease, ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', K_NODES, '-inf', '(' .. now)
return {now + lease, now, expired}
