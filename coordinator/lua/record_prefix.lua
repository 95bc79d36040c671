-- record_prefix: record a routed request's prefix blocks against the chosen instance.
-- The prefix index approximates each engine's prefix KV cache (coordinator/prefix.py):
-- - owners: block hash -> up to `max_owners` space-separated "<id>|<epoch>|<stamp>",
--   most recent last; nodes HMGET it at decision time (coordinator/prefix_index.py);
-- - lru: lex zset "<id>#<epoch:010d>|<stamp:017d>|<hash>", so one instance's current
--   epoch is one lex range in LRU order; its size is bounded by the capacity.
-- stamp = call * 1000 + 999 - position, `call` counting this pool's record calls
-- (meta `prefix_calls`): later calls are newer, even within one millisecond, and
-- within one call the deeper blocks are older, so eviction takes a prefix's tail
-- before its head (as an engine's cache does). Entries of an older epoch are void at once (lookups compare
-- epochs) and their storage is reclaimed here in bounded steps.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:prefix_owners  hash, as above
-- KEYS[18] = {pool}:prefix_lru     lex zset, as above
-- ARGV[1] = instance id
-- ARGV[2] = capacity: blocks kept for the instance (integer >= 0; 0 = record nothing)
-- ARGV[3] = max_owners: instances kept per block (integer 1..64)
-- ARGV[4] = sample (1 = also reclaim void entries of one sampled member; nodes ask
--   on a share of their calls, which keeps the index bounded at a fraction of the cost)
-- ARGV[5..] = block hashes, in prompt order (at most 512, 1..64 chars of [0-9a-f])
-- returns {'ok', recorded, evicted, reclaimed} | {'gone'} (the id is not registered)
local K_OWNERS, K_LRU = KEYS[17], KEYS[18]
local RECLAIM_BUDGET = 256  -- void entries one call may delete
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local capacity = int_arg(ARGV[2], 1e9)
if capacity == nil then return fail('bad_arg', 'capacity must be an integer >= 0') end
local max_owners = int_arg(ARGV[3], 64)
if max_owners == nil or max_owners < 1 then return fail('bad_arg', 'max_owners in 1..64') end
if ARGV[4] ~= '0' and ARGV[4] ~= '1' then return fail('bad_arg', 'sample must be 0 or 1') end
local n = #ARGV - 4
if n > 512 then return fail('bad_arg', 'at most 512 block hashes') end
for i = 5, #ARGV do
  if not string.find(ARGV[i], '^[0-9a-f]+$') or #ARGV[i] > 64 then
    return fail('bad_arg', 'block hash ' .. (i - 4))
  end
end
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return {'gone'} end
epoch = tonumber(epoch)

local unpack = table.unpack or unpack

local function member(owner, e, stamp, hash)
  return owner .. '#' .. string.format('%010d', e) .. '|' .. string.format('%017d', stamp)
    .. '|' .. hash
end

-- The entries of an owners value: {owner, epoch, stamp, text} each.
local function entries(list)
  local out = {}
  if list then
    for entry in string.gmatch(list, '%S+') do
      local o, e, stamp = string.match(entry, '^(.*)|(%d+)|(%d+)$')
      table.insert(out, {o, tonumber(e), tonumber(stamp), entry})
    end
  end
  return out
end

-- Write back owners values: non-empty ones in one HSET, empty ones in one HDEL.
local function write_owners(values)
  local sets, dels = {}, {}
  for hash, list in pairs(values) do
    if #list == 0 then
      table.insert(dels, hash)
    else
      local texts = {}
      for _, entry in ipairs(list) do table.insert(texts, entry[4]) end
      table.insert(sets, hash)
      table.insert(sets, table.concat(texts, ' '))
    end
  end
  if #sets > 0 then redis.call('HSET', K_OWNERS, unpack(sets)) end
  if #dels > 0 then redis.call('HDEL', K_OWNERS, unpack(dels)) end
end

-- Delete lru members in [lo, hi) (at most `budget`) and their owner entries, in a
-- fixed number of calls whatever their count.
local function drop_range(lo, hi, budget)
  if budget <= 0 then return 0 end
  local members = redis.call('ZRANGEBYLEX', K_LRU, lo, hi, 'LIMIT', 0, budget)
  if #members == 0 then return 0 end
  local parsed, hashes, seen = {}, {}, {}
  for _, m in ipairs(members) do
    local owner, e, hash = string.match(m, '^(.*)#(%d+)|%d+|(%x+)$')
    table.insert(parsed, {owner, tonumber(e), hash})
    if not seen[hash] then
      seen[hash] = true
      table.insert(hashes, hash)
    end
  end
  local values = {}
  local lists = redis.call('HMGET', K_OWNERS, unpack(hashes))
  for i, hash in ipairs(hashes) do values[hash] = entries(lists[i] or nil) end
  for _, p in ipairs(parsed) do
    local kept = {}
    for _, entry in ipairs(values[p[3]]) do
      if not (entry[1] == p[1] and entry[2] == p[2]) then table.insert(kept, entry) end
    end
    values[p[3]] = kept
  end
  write_owners(values)
  redis.call('ZREM', K_LRU, unpack(members))
  return #members
end

-- Reclaim void entries: this instance's older epochs, then those of one sampled
-- member (a restarted or unregistered instance is sampled in proportion to the
-- storage it still holds, so every void entry goes away eventually).
local reclaimed = drop_range('[' .. id .. '#', '(' .. id .. '#' .. string.format('%010d', epoch),
  RECLAIM_BUDGET)
local sample = ARGV[4] == '1' and redis.call('ZRANDMEMBER', K_LRU, 1)[1]
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
if capacity > 0 and n > 0 then
  local hashes = {}
  for i = 1, n do hashes[i] = ARGV[4 + i] end
  local lists = redis.call('HMGET', K_OWNERS, unpack(hashes))
  local call = redis.call('HINCRBY', K_META, 'prefix_calls', 1)
  local values, stale, adds = {}, {}, {}
  for i, hash in ipairs(hashes) do
    local stamp = call * 1000 + 999 - (i - 1)
    local kept = {}
    for _, entry in ipairs(entries(lists[i] or nil)) do
      if entry[1] == id then  -- this instance's older entry (any epoch): replaced
        table.insert(stale, member(entry[1], entry[2], entry[3], hash))
      else
        table.insert(kept, entry)
      end
    end
    table.insert(kept, {id, epoch, stamp, id .. '|' .. string.format('%d', epoch) .. '|'
      .. string.format('%d', stamp)})
    while #kept > max_owners do
      local gone = table.remove(kept, 1)
      table.insert(stale, member(gone[1], gone[2], gone[3], hash))
    end
    values[hash] = kept
    table.insert(adds, 0)
    table.insert(adds, member(id, epoch, stamp, hash))
  end
  if #stale > 0 then redis.call('ZREM', K_LRU, unpack(stale)) end
  write_owners(values)
  redis.call('ZADD', K_LRU, unpack(adds))
  recorded = n
end

-- Keep the instance within its capacity, oldest first; evicting only once it is an
-- eighth over (at most 16 blocks) spreads that work over several calls.
local stem = id .. '#' .. string.format('%010d', epoch)
local over = redis.call('ZLEXCOUNT', K_LRU, '[' .. stem .. '|', '(' .. stem .. '}') - capacity
local evicted = 0
if over > math.min(16, math.floor(capacity / 8)) then
  evicted = drop_range('[' .. stem .. '|', '(' .. stem .. '}', math.min(over, 1024))
end
return {'ok', recorded, evicted, reclaimed}
