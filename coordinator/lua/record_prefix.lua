-- record_prefix: record a routed request's prefix blocks against the chosen instance.
-- The prefix index approximates each engine's prefix KV cache (coordinator/prefix.py):
-- - owners: block hash -> up to `max_owners` space-separated
--   "<id>|<epoch>|<stamp>|<weight>", most recent last; nodes HMGET it at decision time
--   (coordinator/prefix_index.py). Fields beside the block hashes (a '#' keeps them
--   apart from hex), so that one HMGET reads and one HSET writes all a call
--   needs: "<id>#<epoch:010d>" -> the blocks the instance's entries stand for (the sum
--   of their weights, which its capacity bounds), "#calls" -> this pool's record
--   calls, the order of the stamps, and "#about" (below);
-- - lru: lex zset "<id>#<epoch:010d>|<stamp:017d>|<weight>|<hash>", so one instance's
--   current epoch is one lex range in LRU order.
-- A node records an entry every few blocks of a prompt and at its last block
-- (Settings.prefix_record_stride), not every block: an entry stands for the blocks
-- since the previous one (its weight), and since a block's hash covers its whole
-- prefix, a lookup credits the deepest entry held, less than a stride short.
-- stamp = call * 1000 + 999 - position: later calls are newer, even within one
-- millisecond, and within one call the deeper entries are older, so eviction takes a
-- prefix's tail before its head (as an engine's cache does). Entries of an older epoch
-- are void at once (lookups compare epochs); sampled calls reclaim their storage in
-- bounded steps.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:prefix_owners  hash, as above
-- KEYS[18] = {pool}:prefix_lru     lex zset, as above
-- ARGV[1] = instance id
-- ARGV[2] = capacity: blocks kept for the instance (integer >= 0; 0 = record nothing)
-- ARGV[3] = max_owners: instances kept per block (integer 1..64)
-- ARGV[4] = sample (1 = also reclaim void entries: this instance's older epochs and
--   those of one sampled member; nodes ask on a share of their calls, which keeps the
--   index bounded at a fraction of the cost)
-- ARGV[5..] = pairs of block hash (1..64 chars of [0-9a-f]) and weight (the blocks it
--   stands for, 1..512; 0 = a refresh: the weight the instance's entry has, else 1),
--   in prompt order, at most 512 pairs
-- returns {'ok', recorded, evicted, reclaimed} | {'gone'} (the id is not registered)
local K_OWNERS, K_LRU = KEYS[17], KEYS[18]
-- The owners hash's "#about" field, written with its first record (below): a value longer
-- than hash-max-listpack-value (64 bytes by default) keeps the hash in Redis's
-- hashtable encoding. As a listpack (up to hash-max-listpack-entries fields: 128 or
-- 512 by default), a lookup's HMGET of up to 128 fields would scan the whole hash
-- once per field. One literal: Lua 5.1 would join two on every call.
local ABOUT = 'prefix index: block hash -> "<id>|<epoch>|<stamp>|<weight>" owners, newest last (coordinator/lua/record_prefix.lua); no prompt text'
local RECLAIM_BUDGET = 256  -- void entries one call may delete
local EVICT_BATCH = 16  -- lru entries one eviction step reads, at most
-- Numbers become text without Lua's tostring (a C sprintf of '%.14g', the costliest
-- step of a call): the epoch, stamps and weights stay the text they arrived as.
local id = ARGV[1]
if not valid_id(id) then return fail('bad_arg', 'instance id') end
local capacity = int_arg(ARGV[2], 1e9)
if capacity == nil then return fail('bad_arg', 'capacity must be an integer >= 0') end
local max_owners = int_arg(ARGV[3], 64)
if max_owners == nil or max_owners < 1 then return fail('bad_arg', 'max_owners in 1..64') end
if ARGV[4] ~= '0' and ARGV[4] ~= '1' then return fail('bad_arg', 'sample must be 0 or 1') end
local n = (#ARGV - 4) / 2
if n ~= math.floor(n) then return fail('bad_arg', 'block hashes and weights come in pairs') end
if n > 512 then return fail('bad_arg', 'at most 512 block hashes') end
local hashes, weights, weight_texts = {}, {}, {}
for i = 1, n do
  local hash = ARGV[3 + 2 * i]
  if #hash < 1 or #hash > 64 then return fail('bad_arg', 'block hash ' .. i) end
  hashes[i] = hash
  local text = ARGV[4 + 2 * i]
  weights[i] = int_arg(text, 512)
  if weights[i] == nil then return fail('bad_arg', 'weight ' .. i) end
  -- the text as written: canonical digits as sent, else the number's own
  if not string.find(text, '^[1-9]%d?%d?$') then text = tostring(weights[i]) end
  weight_texts[i] = text
end
if not string.find(table.concat(hashes), '^[0-9a-f]*$') then  -- one match for all
  return fail('bad_arg', 'block hashes are [0-9a-f]+')
end
-- The epoch as text: HINCRBY writes canonical digits, which the entries repeat.
local epoch = redis.call('HGET', K_EPOCH, id)
if not epoch then return {'gone'} end

local unpack = table.unpack or unpack
local floor = math.floor

-- Digits zero-padded to `width` (never cut: a longer number keeps its digits).
local function pad(digits, width)
  return string.rep('0', width - #digits) .. digits
end
local stem = id .. '#' .. pad(epoch, 10)

-- An owners entry "<id>|<epoch>|<stamp>[|<weight>]" as {id, epoch, stamp, weight,
-- written before weights, weight as text}, the numbers as text but the weight (plain
-- finds: ids have no '|'). Entries from before weights were never counted: weight 0.
local function entry_of(text)
  local a = string.find(text, '|', 1, true)
  local b = a and string.find(text, '|', a + 1, true)
  if not b then return {nil, nil, nil, 0, true, '0'} end  -- not an entry: no owner
  local c = string.find(text, '|', b + 1, true)
  local o, e = string.sub(text, 1, a - 1), string.sub(text, a + 1, b - 1)
  if c then
    local w = string.sub(text, c + 1)
    return {o, e, string.sub(text, b + 1, c - 1), tonumber(w), false, w}
  end
  return {o, e, string.sub(text, b + 1), 0, true, '0'}
end

local function stem_of(owner, e)
  return owner .. '#' .. pad(e, 10)
end

-- The lru member of an owners entry of `hash`.
local function member_of(entry, hash)
  local weight = entry[5] and '' or entry[6] .. '|'
  return stem_of(entry[1], entry[2]) .. '|' .. pad(entry[3], 17) .. '|' .. weight .. hash
end

-- An lru member as {stem, owners entry prefix "<id>|<epoch>|", weight, hash} (ids
-- have no '#' or '|'; the epoch as the owners entries write it, without padding).
-- Plain finds: "<id>#<epoch>|<stamp>|<weight>|<hash>", or without the weight when
-- written before weights (never counted: weight 0).
local function parse_member(m)
  local sharp = string.find(m, '#', 1, true)
  local a = string.find(m, '|', sharp + 1, true)
  local b = string.find(m, '|', a + 1, true)
  local c = string.find(m, '|', b + 1, true)
  local owner, e = string.sub(m, 1, sharp - 1), string.sub(m, sharp + 1, a - 1)
  local w, hash = 0, nil
  if c then
    w, hash = tonumber(string.sub(m, b + 1, c - 1)), string.sub(m, c + 1)
  else
    hash = string.sub(m, b + 1)
  end
  local digit = string.find(e, '[1-9]')
  local unpadded = digit and string.sub(e, digit) or '0'
  return {string.sub(m, 1, a - 1), owner .. '|' .. unpadded .. '|', w, hash}
end

-- Changes to the owners hash, written at the end in one HSET (and one HDEL): field ->
-- value ('' = delete), counts as numbers. `load` reads the fields not read yet.
local values = {}
local function load(fields)
  local missing = {}
  for _, f in ipairs(fields) do
    if values[f] == nil then missing[#missing + 1] = f end
  end
  if #missing == 0 then return end
  local got = redis.call('HMGET', K_OWNERS, unpack(missing))
  for i, f in ipairs(missing) do values[f] = got[i] or '' end
end
local function add_count(field, delta)
  if values[field] == nil then load({field}) end
  values[field] = (tonumber(values[field]) or 0) + delta
end

-- Take these lru members (parse_member's) out of the owners values and counts (loaded
-- first); the caller removes them from the lru. An owners entry is the member's when
-- it starts with the member's "<id>|<epoch>|": a prefix compare, no pattern.
local function unlink(parsed)
  local fields = {}
  for _, p in ipairs(parsed) do
    fields[#fields + 1] = p[4]
    fields[#fields + 1] = p[1]
  end
  load(fields)
  for _, p in ipairs(parsed) do
    local kept, head = {}, p[2]
    for text in string.gmatch(values[p[4]], '%S+') do
      if string.sub(text, 1, #head) ~= head then kept[#kept + 1] = text end
    end
    values[p[4]] = table.concat(kept, ' ')
    add_count(p[1], -p[3])
  end
end

-- Reclaim void entries (on sampled calls): this instance's older epochs, then those of
-- one sampled member (a restarted or unregistered instance is sampled in proportion
-- to the storage it still holds, so every void entry goes away eventually).
local reclaimed = 0
local function reclaim(lo, hi)
  local members = redis.call('ZRANGEBYLEX', K_LRU, lo, hi, 'LIMIT', 0,
    RECLAIM_BUDGET - reclaimed)
  if #members == 0 then return end
  local parsed = {}
  for i, m in ipairs(members) do parsed[i] = parse_member(m) end
  unlink(parsed)
  redis.call('ZREM', K_LRU, unpack(members))
  reclaimed = reclaimed + #members
end
if ARGV[4] == '1' then
  reclaim('[' .. id .. '#', '(' .. stem)
  local sample = redis.call('ZRANDMEMBER', K_LRU, 1)[1]
  if sample and reclaimed < RECLAIM_BUDGET then
    local owner, e = string.match(sample, '^([^#]*)#(%d+)|')
    local current = redis.call('HGET', K_EPOCH, owner)
    if not current or tonumber(current) ~= tonumber(e) then
      reclaim('[' .. owner .. '#' .. e .. '|', '(' .. owner .. '#' .. e .. '}')
    end
  end
end

local recorded = 0
if capacity > 0 and n > 0 then
  load({'#calls', stem, unpack(hashes)})
  local fresh = values['#calls'] == ''
  if fresh then  -- the count the index kept before weights, if any
    values['#calls'] = redis.call('HGET', K_META, 'prefix_calls') or ''
  end
  -- "#about" with the hash's first record; sampled calls check for it too, so that
  -- an index written before it existed gets it within a few calls.
  if fresh or (ARGV[4] == '1' and redis.call('HEXISTS', K_OWNERS, '#about') == 0) then
    values['#about'] = ABOUT
  end
  local call = (tonumber(values['#calls']) or 0) + 1
  local call_text = tostring(call)
  values['#calls'] = call_text
  -- stamp = call * 1000 + 999 - (i - 1): with at most 512 entries its last three
  -- digits are 488..999, so the padded stamp is the padded call and those digits.
  local call_pad = pad(call_text, 14)
  local stale, adds = {}, {}
  local mark = id .. '|'
  local head = mark .. epoch .. '|'
  for i, hash in ipairs(hashes) do
    local d = 1000 - i  -- three digits, 488..999
    local last = string.char(48 + floor(d / 100), 48 + floor(d / 10) % 10, 48 + d % 10)
    local weight, weight_text = weights[i], weight_texts[i]
    local list, kept = values[hash], ''
    if list ~= '' then
      local others, count, first = {}, 0, 1
      for text in string.gmatch(list, '%S+') do
        local e = string.sub(text, 1, #mark) == mark and entry_of(text)
        if e and e[1] == id then  -- this instance's older entry (any epoch): replaced
          stale[#stale + 1] = member_of(e, hash)
          if weight == 0 and e[2] == epoch then weight, weight_text = e[4], e[6] end
          add_count(stem_of(id, e[2]), -e[4])
        else
          count = count + 1
          others[count] = text
        end
      end
      while count - first + 1 >= max_owners do  -- room for this entry
        local gone = entry_of(others[first])
        stale[#stale + 1] = member_of(gone, hash)
        add_count(stem_of(gone[1], gone[2]), -gone[4])
        first = first + 1
      end
      if first <= count then kept = table.concat(others, ' ', first) .. ' ' end
    end
    if weight == 0 then weight, weight_text = 1, '1' end
    add_count(stem, weight)
    values[hash] = kept .. head .. call_text .. last .. '|' .. weight_text
    adds[#adds + 1] = '0'  -- a string: Redis would format a number
    adds[#adds + 1] = stem .. '|' .. call_pad .. last .. '|' .. weight_text .. '|' .. hash
  end
  if #stale > 0 then redis.call('ZREM', K_LRU, unpack(stale)) end
  redis.call('ZADD', K_LRU, unpack(adds))
  recorded = n
end

-- Keep the instance within its capacity, oldest first; evicting only once it is an
-- eighth over (at most 16 blocks) spreads that work over several calls.
if values[stem] == nil then load({stem}) end
local over = (tonumber(values[stem]) or 0) - capacity
local evicted = 0
if over > math.min(16, floor(capacity / 8)) then
  local lo, hi = '[' .. stem .. '|', '(' .. stem .. '}'
  while over > 0 and evicted < 1024 do
    -- entries weigh a stride of blocks or so: read about as many as `over` needs
    local limit = math.min(EVICT_BATCH, floor(over / 4) + 1)
    local batch = redis.call('ZRANGEBYLEX', K_LRU, lo, hi, 'LIMIT', 0, limit)
    if #batch == 0 then  -- the count drifted above what is stored: trust the store
      values[stem] = 0
      break
    end
    local take, parsed = {}, {}
    for _, m in ipairs(batch) do
      if over <= 0 then break end
      local p = parse_member(m)
      take[#take + 1] = m
      parsed[#parsed + 1] = p
      over = over - p[3]
    end
    unlink(parsed)
    redis.call('ZREM', K_LRU, unpack(take))
    evicted = evicted + #take
  end
end

local sets, dels = {}, {}
for field, value in pairs(values) do
  if value == '' or (type(value) == 'number' and value <= 0) then
    dels[#dels + 1] = field
  else
    sets[#sets + 1] = field
    sets[#sets + 1] = value
  end
end
if #sets > 0 then redis.call('HSET', K_OWNERS, unpack(sets)) end
if #dels > 0 then redis.call('HDEL', K_OWNERS, unpack(dels)) end
return {'ok', recorded, evicted, reclaimed}
