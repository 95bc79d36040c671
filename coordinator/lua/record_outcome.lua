-- record_outcome: passive health (outlier detection), shared by every node of the pool.
-- A failed exchange adds to the instance's consecutive failures; reaching the
-- threshold ejects it for a time that doubles with each repeat (Envoy outlier
-- detection), unless the ejected share of the alive instances would then exceed
-- the cap (Envoy max_ejection_percent). A success resets the count. Failures further
-- apart than the window do not add up (nginx max_fails within fail_timeout).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:outliers  hash "<id>:fails", "<id>:last_fail_ms", "<id>:until_ms",
--   "<id>:ejections", "<id>:reason", "<id>:cordon" (an operator's reason, set while the
--   instance is cordoned), "<id>:epoch" (coordinator/keys.py PoolKeys.outliers); a
--   record of an older epoch is void: a restarted engine starts clean, uncordoned
-- KEYS[18] = {pool}:ejected  zset instance id -> ejected until (Redis ms): the ejected
--   share is one ZCARD, so an ejection never scans the pool (at 10,000 instances the
--   scan took 24 ms, and ran again on every failure once the cap was reached)
-- ARGV[1] = instance id
-- ARGV[2] = outcome: 'ok', 'fail', or 'rate': a failure that ejects whatever the count
--   (the calling node's share of failed exchanges with the instance reached its
--   threshold: coordinator/outliers.py FailureShares), unless the share cap says no;
--   or an operator's 'cordon' (no node sends the instance new requests until
--   'uncordon'; requests in flight finish), which neither counts nor caps
-- ARGV[3] = consecutive failures that eject (integer >= 1)
-- ARGV[4] = failure window in ms (integer >= 1)
-- ARGV[5] = first ejection in ms (integer >= 1)
-- ARGV[6] = longest ejection in ms (integer >= ARGV[5]); also how long an instance must
--   stay un-ejected before its next ejection starts from the first length again
-- ARGV[7] = most instances ejected at once, in percent of the alive ones (0..100)
-- ARGV[8] = alive instances as the calling node's view counts them (integer >= 0; the
--   share's denominator, this instance included at least)
-- ARGV[9] = reason of a failure (short text for operators, e.g. 'status_503') or of a
--   cordon (at most 200 bytes kept)
-- returns {state, consecutive_failures, ejected_until_ms, ejections, now_ms}
--   state: 'ok' | 'counted' (below the threshold) | 'ejected' (by this call)
--   | 'already' (ejected before; nothing changed) | 'capped' (at the threshold, but the
--   share is used up) | 'cordoned' | 'uncordoned' | 'unknown' (no such instance)
local O = KEYS[17]
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local outcome = ARGV[2]
if outcome ~= 'ok' and outcome ~= 'fail' and outcome ~= 'rate' and outcome ~= 'cordon'
    and outcome ~= 'uncordon' then
  return fail('bad_arg', 'outcome')
end
local threshold = int_arg(ARGV[3], 1000000)
local window = int_arg(ARGV[4], 86400000)
local base = int_arg(ARGV[5], 86400000)
local longest = int_arg(ARGV[6], 86400000)
local percent = tonumber(ARGV[7])
local alive_seen = int_arg(ARGV[8], 1e9)
if threshold == nil or threshold < 1 or window == nil or window < 1 or base == nil
    or base < 1 or longest == nil or longest < base or alive_seen == nil then
  return fail('bad_arg', 'outlier policy')
end
if percent == nil or percent ~= percent or percent < 0 or percent > 100 then
  return fail('bad_arg', 'max ejection percent must be in 0..100')
end
local now = now_ms()
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return {'unknown', 0, 0, 0, now} end
local function field(name) return tonumber(redis.call('HGET', O, id .. ':' .. name) or '0') end
-- Forget the instance's failures and ejections (and, with `record_too`, its record,
-- unless it is cordoned).
local function clear(record_too)
  redis.call('HDEL', O, id .. ':fails', id .. ':last_fail_ms', id .. ':until_ms',
    id .. ':ejections', id .. ':reason')
  if record_too and not redis.call('HGET', O, id .. ':cordon') then
    redis.call('HDEL', O, id .. ':epoch')
  end
  redis.call('ZREM', KEYS[18], id)
end
if redis.call('HGET', O, id .. ':epoch') ~= epoch then
  clear(false)
  redis.call('HDEL', O, id .. ':cordon')
  redis.call('HSET', O, id .. ':epoch', epoch)
end
local until_ms, ejections, fails = field('until_ms'), field('ejections'), field('fails')
if outcome == 'cordon' then
  redis.call('HSET', O, id .. ':cordon', string.sub(ARGV[9] or '', 1, 200))
  return {'cordoned', fails, until_ms, ejections, now}
end
if outcome == 'uncordon' then
  redis.call('HDEL', O, id .. ':cordon')
  if not redis.call('HGET', O, id .. ':last_fail_ms') and until_ms == 0 then
    redis.call('HDEL', O, id .. ':epoch')  -- nothing else on record: the record goes
  end
  return {'uncordoned', fails, until_ms, ejections, now}
end
if until_ms > now then return {'already', fails, until_ms, ejections, now} end
if outcome == 'ok' then
  if until_ms == 0 or now - until_ms > longest then
    -- Healthy, with no ejection the next one would count from: the record goes, so
    -- the hash holds only instances failing or recently ejected (read_outliers reads
    -- it all, every node every second).
    clear(true)
    return {'ok', 0, 0, 0, now}
  end
  if fails ~= 0 then redis.call('HSET', O, id .. ':fails', 0) end
  return {'ok', 0, until_ms, ejections, now}
end
if fails > 0 and now - field('last_fail_ms') > window then fails = 0 end
fails = fails + 1
redis.call('HSET', O, id .. ':fails', fails, id .. ':last_fail_ms', string.format('%d', now),
  id .. ':reason', string.sub(ARGV[9] or '', 1, 64))
if fails < threshold and outcome ~= 'rate' then
  return {'counted', fails, until_ms, ejections, now}
end
-- The share cap: ejections that ended leave the zset here. A node with no view of the
-- pool (0) gets the registered instances as the denominator.
redis.call('ZREMRANGEBYSCORE', KEYS[18], '-inf', string.format('%d', now))
local alive = alive_seen
if alive == 0 then alive = redis.call('HLEN', K_SLOT) end
alive = math.max(1, alive)
local ejected = redis.call('ZCARD', KEYS[18])
if (ejected + 1) * 100 > alive * percent then return {'capped', fails, until_ms, ejections, now} end
if until_ms > 0 and now - until_ms > longest then ejections = 0 end
local duration = math.min(base * math.pow(2, math.min(ejections, 40)), longest)
ejections = ejections + 1
until_ms = now + duration
redis.call('HSET', O, id .. ':until_ms', string.format('%d', until_ms),
  id .. ':ejections', ejections, id .. ':fails', 0)
redis.call('ZADD', KEYS[18], string.format('%d', until_ms), id)
return {'ejected', fails, until_ms, ejections, now}
