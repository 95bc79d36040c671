-- record_prefix: record a routed request's prefix blocks against the chosen instance,
-- in the prefix index (coordinator/prefix_entries.py says its format and what it
-- means). One round trip: the instance's count grows by the blocks the record adds,
-- which gives its entries their positions, deepest first; each block's owners get this
-- instance's entry as the newest (its older one, of any epoch, replaced; anything in
-- the value that is no entry dropped) and keep at most `max_owners`. The deepest
-- pair is the prompt's last block; every other entry ends in '+' and the Redis time
-- in seconds (the prompt went on past the block then: another prompt credited there
-- soon after shares a prefix with it, and is not its next turn). One HMGET and one
-- HSET, the fewest strings in and out of Lua: this runs once per request.
-- KEYS[1] = {pool}:prefix_index (only this key: no pool columns)
-- ARGV[1] = "<id>#<epoch>" (an instance id, its epoch as the node's view has it)
-- ARGV[2] = max_owners: instances kept per block (integer 1..64)
-- ARGV[3..] = pairs of block hash (1..64 chars of [0-9a-f]) and weight (the blocks it
--   adds, 0..512; 0 = a refresh of a block the instance holds), in prompt order, at
--   most 512 pairs, the last one the prompt's last block
-- returns the instance's count after the record
local INDEX = KEYS[1]
local stem = ARGV[1]
local id, epoch = string.match(stem or '', '^(.+)#(%d+)$')
if not id or not valid_id(id) then return fail('bad_arg', 'expected <id>#<epoch>') end
local max_owners = int_arg(ARGV[2], 64)
if max_owners == nil or max_owners < 1 then return fail('bad_arg', 'max_owners in 1..64') end
local n = (#ARGV - 2) / 2
if n < 1 or n ~= math.floor(n) or n > 512 then
  return fail('bad_arg', '1..512 pairs of block hash and weight')
end
local fields, weights, added = {stem}, {}, 0  -- the count, then the blocks
for i = 1, n do
  local hash = ARGV[1 + 2 * i]
  if #hash < 1 or #hash > 64 then return fail('bad_arg', 'block hash ' .. i) end
  fields[i + 1] = hash
  weights[i] = int_arg(ARGV[2 + 2 * i], 512)
  if weights[i] == nil then return fail('bad_arg', 'weight ' .. i) end
  added = added + weights[i]
end
if not string.find(table.concat(fields, '', 2), '^[0-9a-f]*$') then  -- one match for all
  return fail('bad_arg', 'block hashes are [0-9a-f]+')
end
local unpack = table.unpack or unpack
local got = redis.call('HMGET', INDEX, unpack(fields))
-- a count that is no number (a hand edit, say) starts again: a missed credit
local count = (tonumber(got[1]) or 0) + added
local mine = id .. '#'
local inside = '+' .. redis.call('TIME')[1]  -- the suffix of entries inside the prompt
local sets = {stem, count, mine, epoch}
local position = count - added
for i = n, 1, -1 do  -- deepest first
  position = position + weights[i]
  local kept, list = '', got[i + 1]
  if list then
    local others, k = {}, 0
    for text in string.gmatch(list, '%S+') do
      -- another instance's entry (anything else in the value is dropped)
      if string.sub(text, 1, #mine) ~= mine and (string.find(text, '^[^#|]+#%d+|%d+$')
          or string.find(text, '^[^#|]+#%d+|%d+%+%d+$')) then
        k = k + 1
        others[k] = text
      end
    end
    local first = math.max(1, k - max_owners + 2)  -- room for this entry
    if first <= k then kept = table.concat(others, ' ', first) .. ' ' end
  end
  sets[#sets + 1] = fields[i + 1]
  sets[#sets + 1] = kept .. stem .. '|' .. position .. (i < n and inside or '')
end
redis.call('HSET', INDEX, unpack(sets))
return count
