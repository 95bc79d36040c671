-- renew_lease: extend a node's lease and list the nodes whose lease expired, and how
-- many instances still have void records to sweep (sweep.lua).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:owner  hash: `incarnation`, the process that renewed
--   the lease last (expires with the lease)
-- KEYS[18] = {pool}:node:<node>:rids (optional): the node's reservation ids, counted
-- ARGV[1] = node id
-- ARGV[2] = lease length in ms (integer > 0)
-- ARGV[3] = the calling process's incarnation (an id, random per process)
-- ARGV[4] = audit period in ms (0 = no audit): the pool's bookkeeping is checked
--   against itself, one bounded step at most once per period for the whole fleet
--   (audit, below); optional, 0 when absent
-- ARGV[5] = instances whose counters, and reservations whose node, one audit step
--   checks (1..256; default 64)
-- returns {status, deadline_ms, now_ms, expired_node_ids, void_instances_left,
--          previous_incarnation, audit, rids, orphans}
--   status 'ok': the lease was still live; 'expired': it had run out (a peer may be
--   reaping this node's reservations); 'new': there was none (never held, reaped,
--   or Redis lost the pool). After 'expired' or 'new' a node that held a lease must
--   re-assert its reservations.
--   previous_incarnation: who renewed the lease before this call ('' if nobody within
--   a lease). Another one than the caller's, after the caller had renewed, means a
--   second process runs under the same node id.
--   audit: '' or, when a relation between the pool's keys did not hold, what did
--   not: the pool's keys were then deleted before the renewal, as by FLUSHDB (a new
--   run_id: every node re-asserts what it registered and holds, as after any loss of
--   the pool), so that the counters carry no lost or hand-edited key for good.
--   rids: how many ids KEYS[18] holds (-1 without it): never fewer than the
--   reservations the node holds in Redis, unless the set was lost or edited (the
--   reaper then could not release them when the node dies).
--   orphans: reservations the audit step released because their node holds no lease
--   at all: a node the reaper removed (after its rids set, lost or edited, named
--   them no more) or a lost `nodes` key; nothing else would ever release them.
if not valid_id(ARGV[1]) then return fail('bad_arg', 'node') end
local lease = int_arg(ARGV[2], 86400000)
if lease == nil or lease < 1 then return fail('bad_arg', 'lease_ms must be an integer > 0') end
if not valid_id(ARGV[3]) then return fail('bad_arg', 'incarnation') end
local period = int_arg(ARGV[4] or '0', 86400000)
if period == nil then return fail('bad_arg', 'audit period_ms must be an integer >= 0') end
local per_step = int_arg(ARGV[5] or '64', 256)
if per_step == nil or per_step < 1 then return fail('bad_arg', 'audit step in 1..256') end

-- One bounded step of an HSCAN of `key` that resumes where the last step stopped:
-- `cursor`, and `offset` into a reply longer than `per_step` (a small hash comes
-- whole). Returns the reply's field/value list, the first and last pair to visit, and
-- the position after them.
local function scan_step(key, cursor, offset, per_step)
  cursor, offset = cursor or '0', tonumber(offset) or 0
  local scan = redis.call('HSCAN', key, cursor, 'COUNT', per_step)
  local found = scan[2]
  local last = math.min(#found / 2, offset + per_step)
  if last < #found / 2 then return found, offset + 1, last, cursor, last end
  return found, offset + 1, last, scan[1], 0
end

-- The first relation between the pool's keys that does not hold, or nil. Every
-- script keeps each one: a key lost to eviction (a maxmemory-policy other than
-- noeviction), deleted or edited by hand breaks one. Each step checks the pool-wide
-- ones and the counters of `per_step` instances, in O(per_step) commands: the next
-- ones a scan_step of `slot` returns.
local function check_relations(m)
  local held = redis.call('HLEN', K_SLOT)
  if (tonumber(m[4]) or 0) ~= held + redis.call('ZCARD', K_FREE_SLOTS) then
    return 'meta slots is not the slots held plus free_slots'
  end
  for _, key in ipairs({K_SPEC, K_EPOCH, K_MAX_SLOTS, K_LAST_SEEN}) do
    if redis.call('HLEN', key) ~= held then return key .. ' and slot name other instances' end
  end
  local records = redis.call('HLEN', K_RES)
  if records ~= redis.call('ZCARD', K_BY_INSTANCE) then
    return 'reservations and by_instance hold other reservations'
  end
  -- Every record counts in `state` (inflight_total is its sum) but the void ones,
  -- whose instances `voids` lists until they are swept.
  local total = tonumber(m[5]) or 0
  if total < 0 or total > records
      or (total < records and redis.call('SCARD', K_VOIDS) == 0) then
    return string.format('meta inflight_total is %d, reservations %d', total, records)
  end
  local found, first, last, cursor, offset = scan_step(K_SLOT, m[2], m[3], per_step)
  for j = first, last do
    local id = found[2 * j - 1]
    local epoch = tonumber(redis.call('HGET', K_EPOCH, id))
    if not epoch then return 'slot names ' .. id .. ', epoch does not' end
    local lo, hi = epoch_range(id, epoch)
    local indexed = redis.call('ZLEXCOUNT', K_BY_INSTANCE, lo, hi)
    local pending, decode = state_fields(tonumber(found[2 * j]))
    if pending + decode ~= indexed then
      return string.format('state counts %d reservations on %s, by_instance %d',
        pending + decode, id, indexed)
    end
  end
  return nil, cursor, offset
end

-- Release the orphans among the next `per_step` reservations (a scan_step of
-- `reservations`): records whose node is not in `nodes` at all. A node is there from
-- its first reserve or renewal until the reaper has released everything its rids set
-- names; a record outliving that (the set was lost or edited before the node died,
-- or `nodes` itself was lost) has no one left to release it. Returns how many it
-- released and the scan's position.
local function release_orphans(m, now)
  local found, first, last, cursor, offset = scan_step(K_RES, m[6], m[7], per_step)
  local leased, touched, released = {[ARGV[1]] = true}, {}, 0  -- the caller is alive
  for j = first, last do
    local raw = found[2 * j]
    local node = string.match(raw, '"node":"([^"]*)"')
    if node and leased[node] == nil then
      leased[node] = redis.call('ZSCORE', K_NODES, node) ~= false
    end
    if node and not leased[node] then
      drop_reservation(found[2 * j - 1], cjson.decode(raw), now, touched)
      released = released + 1
    end
  end
  sync_touched(touched)
  commit_state()
  return released, cursor, offset
end

-- One audit step when one is due: what did not hold ('' when all did), and how many
-- orphaned reservations it released.
local function audit(now)
  local m = redis.call('HMGET', K_META, 'audit_at', 'audit_cursor', 'audit_offset', 'slots',
    'inflight_total', 'orphan_cursor', 'orphan_offset')
  if tonumber(m[1] or '0') > now then return '', 0 end
  local found, cursor, offset = check_relations(m)
  if found then return found, 0 end
  local released, orphan_cursor, orphan_offset = release_orphans(m, now)
  redis.call('HSET', K_META, 'audit_at', now + period, 'audit_cursor', cursor,
    'audit_offset', offset, 'orphan_cursor', orphan_cursor, 'orphan_offset', orphan_offset)
  return '', released
end

local now = now_ms()
run_id(now)
local found, orphans = '', 0
if period > 0 then
  found, orphans = audit(now)
  if found ~= '' then
    redis.call('UNLINK', unpack(KEYS, 1, 16))  -- the pool's columns
    run_id(now)
    redis.call('HSET', K_META, 'audit_at', now + period, 'audit_reset', found,
      'audit_reset_ms', string.format('%d', now))
  end
end
local prior = redis.call('ZSCORE', K_NODES, ARGV[1])
local status = 'new'
if prior then status = tonumber(prior) >= now and 'ok' or 'expired' end
redis.call('ZADD', K_NODES, now + lease, ARGV[1])
local previous = redis.call('HGET', KEYS[17], 'incarnation') or ''
redis.call('HSET', KEYS[17], 'incarnation', ARGV[3])
redis.call('PEXPIRE', KEYS[17], lease)
local expired = redis.call('ZRANGEBYSCORE', K_NODES, '-inf', '(' .. now)
local rids = KEYS[18] and redis.call('SCARD', KEYS[18]) or -1
return {status, now + lease, now, expired, redis.call('SCARD', K_VOIDS), previous, found, rids,
  orphans}
