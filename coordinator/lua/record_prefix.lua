-- record_prefix: record a routed request's prefix blocks against the chosen instance.
-- The prefix index approximates each engine's prefix KV cache (coordinator/prefix.py):
-- - owners: block hash -> up to `max_owners` space-separated "<id>|<epoch>|<stamp>",
--   most recent last; nodes HMGET it at decision time (coordinator/prefix_index.py);
-- - lru: lex zset "<id>#<epoch:010d>|<stamp:017d>|<hash>", so one instance's current
--   epoch is one lex range in LRU order; its size is bounded by the capacity.
-- stamp = now_ms * 1000 + 999 - position: newer first, and within one request the
-- deeper blocks are older, so eviction takes a prefix's tail before its head (as an
-- engine's cache does). Entries of an older epoch are void at once (lookups compare
-- epochs) and their storage is reclaimed here in bounded steps.
-- KEYS[1..21] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[22] = {pool}:prefix_owners  hash, as above
-- KEYS[23] = {pool}:prefix_lru     lex zset, as above
-- ARGV[1] = instance id
-- ARGV[2] = capacity: blocks kept for the instance (integer >= 0; 0 = record nothing)
-- ARGV[3] = max_owners: instances kept per block (integer 1..64)
-- ARGV[4..] = block hashes, in prompt order (at most 512, 1..64 chars of [0-9a-f])
-- returns {'ok', recorded, evicted, reclaimed} | {'gone'} (the id is not registered)
local K_OWNERS, K_LRU = KEYS[22], KEYS[23]
local RECLAIM_BUDGET = 256  -- void entries one call may delete
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local capacity = int_arg(ARGV[2], 1e9)
if capacity == nil then return fail('bad_arg', 'capacity must be an integer >= 0') end
local max_owners = int_arg(ARGV[3], 64)
if max_owners == nil or max_owners < 1 then return fail('bad_arg', 'max_owners in 1..64') end
local n = #ARGV - 3
if n > 512 then return fail('bad_arg', 'at most 512 block hashes') end
for i = 4, #ARGV do
  if not string.find(ARGV[i], '^[0-9a-f]+$') or #ARGV[i] > 64 then
    return fail('bad_arg', 'block hash ' .. (i - 3))
  end
end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return {'gone'} end
epoch = tonumber(epoch)
local now = now_ms()

local function member(owner, e, stamp, hash)
  return owner .. '#' .. string.format('%010d', e) .. '|' .. string.format('%017d', stamp)
    .. '|' .. hash
end

-- Drop the entry of `owner` at epoch `epoch` from a block's owners, with its lru member.
local function forget(hash, owner, epoch)
  local list = redis.call('HGET', K_OWNERS, hash)
  if not list then return end
  local kept = {}
  for entry in string.gmatch(list, '%S+') do
    local o, e, stamp = string.match(entry, '^(.*)|(%d+)|(%d+)$')
    if o == owner and tonumber(e) == epoch then
      redis.call('ZREM', K_LRU, member(o, epoch, tonumber(stamp), hash))
    else
      table.insert(kept, entry)
    end
  end
  if #kept == 0 then
    redis.call('HDEL', K_OWNERS, hash)
  else
    redis.call('HSET', K_OWNERS, hash, table.concat(kept, ' '))
  end
end

-- Delete lru members in [lo, hi) (at most `budget`) with their owner entries.
local function drop_range(lo, hi, budget)
  if budget <= 0 then return 0 end
  local members = redis.call('ZRANGEBYLEX', K_LRU, lo, hi, 'LIMIT', 0, budget)
  for _, m in ipairs(members) do
    local owner, e, hash = string.match(m, '^(.*)#(%d+)|%d+|(%x+)$')
    forget(hash, owner, tonumber(e))
    redis.call('ZREM', K_LRU, m)  -- also when the owner entry was already gone
  end
  return #members
end

-- Reclaim void entries: this instance's older epochs, then those of one sampled
-- member (a restarted or unregistered instance is sampled in proportion to the
-- storage it still holds, so every void entry goes away eventually).
local reclaimed = drop_range('[' .. id .. '#', '(' .. id .. '#' .. string.format('%010d', epoch),
  RECLAIM_BUDGET)
local sample = redis.call('ZRANDMEMBER', K_LRU, 1)[1]
if sample then
  local owner, e = string.match(sample, '^(.*)#(%d+)|')
  local current = redis.call('HGET', K_EPOCH, owner)
  if not current or tonumber(current) ~= tonumber(e) then
    local stem = owner .. '#' .. e
    reclaimed = reclaimed + drop_range('[' .. stem .. '|', '(' .. stem .. '}',
      RECLAIM_BUDGET - reclaimed)
  end
end

local recorded = 0
if capacity > 0 then
  local mine = id .. '|' .. string.format('%d', epoch) .. '|'
  local updates, adds = {}, {}
  for i = 1, n do
    local hash = ARGV[3 + i]
    local stamp = now * 1000 + 999 - (i - 1)
    local kept = {}
    local list = redis.call('HGET', K_OWNERS, hash)
    if list then
      for entry in string.gmatch(list, '%S+') do
        local o, e, s = string.match(entry, '^(.*)|(%d+)|(%d+)$')
        if o == id then
          redis.call('ZREM', K_LRU, member(o, tonumber(e), tonumber(s), hash))
        else
          table.insert(kept, entry)
        end
      end
    end
    table.insert(kept, mine .. string.format('%d', stamp))
    while #kept > max_owners do
      local o, e, s = string.match(table.remove(kept, 1), '^(.*)|(%d+)|(%d+)$')
      redis.call('ZREM', K_LRU, member(o, tonumber(e), tonumber(s), hash))
    end
    table.insert(updates, hash)
    table.insert(updates, table.concat(kept, ' '))
    table.insert(adds, 0)
    table.insert(adds, member(id, epoch, stamp, hash))
    recorded = recorded + 1
  end
  if recorded > 0 then
    redis.call('HSET', K_OWNERS, (table.unpack or unpack)(updates))
    redis.call('ZADD', K_LRU, (table.unpack or unpack)(adds))
  end
end

-- Keep the instance within its capacity, oldest first.
local stem = id .. '#' .. string.format('%010d', epoch)
local over = redis.call('ZLEXCOUNT', K_LRU, '[' .. stem .. '|', '(' .. stem .. '}') - capacity
local evicted = 0
if over > 0 then
  evicted = drop_range('[' .. stem .. '|', '(' .. stem .. '}', math.min(over, 1024))
end
return {'ok', recorded, evicted, reclaimed}
