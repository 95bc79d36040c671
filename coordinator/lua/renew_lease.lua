-- renew_lease: extend a node's lease and list the nodes whose lease expired, and how
-- many instances still have void records to sweep (sweep.lua).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:owner  hash: `incarnation`, the process that renewed
--   the lease last (expires with the lease)
-- ARGV[1] = node id
-- ARGV[2] = lease length in ms (integer > 0)
-- ARGV[3] = the calling process's incarnation (an id, random per process)
-- returns {status, deadline_ms, now_ms, expired_node_ids, void_instances_left,
--          previous_incarnation}
--   status 'ok': the lease was still live; 'expired': it had run out (a peer may be
--   reaping this node's reservations); 'new': there was none (never held, reaped,
--   or Redis lost the pool). After 'expired' or 'new' a node that held a lease must
--   re-assert its reservations.
--   previous_incarnation: who renewed the lease before this call ('' if nobody within
--   a lease). Another one than the caller's, after the caller had renewed, means a
--   second process runs under the same node id.
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
local lease = int_arg(ARGV[2], 86400000)
if lease == nil or lease < 1 then return fail('bad_arg', 'lease_ms must be an integer > 0') end
if not valid_id(ARGV[3]) then return fail('bad_arg', 'incarnation') end
local now = now_ms()
run_id(now)
local prior = redis.call('ZSCORE', K_NODES, ARGV[1])
local status = 'new'
if prior then status = tonumber(prior) >= now and 'ok' or 'expired' end
redis.call('ZADD', K_NODES, now + lease, ARGV[1])
local previous = redis.call('HGET', KEYS[17], 'incarnation') or ''
redis.call('HSET', KEYS[17], 'incarnation', ARGV[3])
redis.call('PEXPIRE', KEYS[17], lease)
local expired = redis.call('ZRANGEBYSCORE', K_NODES, '-inf', '(' .. now)
return {status, now + lease, now, expired, redis.call('SCARD', K_VOIDS), previous}
