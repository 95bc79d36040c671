-- renew_lease: extend a node's lease and list the nodes whose lease expired, and how
-- many instances still have void records to sweep (sweep.lua).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = node id
-- ARGV[2] = lease length in ms (integer > 0)
-- returns {status, deadline_ms, now_ms, expired_node_ids, void_instances_left}
--   status 'ok': the lease was still live; 'expired': it had run out (a peer may be
--   reaping this node's reservations); 'new': there was none (never held, reaped,
--   or Redis lost the pool). After 'expired' or 'new' a node that held a lease must
--   re-assert its reservations.
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
local lease = int_arg(ARGV[2], 86400000)
if lease == nil or lease < 1 then return fail('bad_arg', 'lease_ms must be an integer > 0') end
local now = now_ms()
run_id(now)
local prior = redis.call('ZSCORE', K_NODES, ARGV[1])
local status = 'new'
if prior then status = tonumber(prior) >= now and 'ok' or 'expired' end
redis.call('ZADD', K_NODES, now + lease, ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', K_NODES, '-inf', '(' .. now)
return {status, now + lease, now, expired, redis.call('SCARD', K_VOIDS)}
