-- merge_timing: fold one node's timing samples into the pool's learned statistics,
-- and return them all (coordinator/timing.py documents the record and the merge,
-- and merge_record there is this merge in Python).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:timing  hash: instance id (or "|output|<model>") -> hex of a msgpack
--   record [epoch, at_ms, n, w, sx, sy, sxx, sxy, ...] (a group of six per fitted line);
--   hex keeps replies text for clients that decode them
-- ARGV[1] = half-life of the statistics' weight in ms (integer >= 1)
-- ARGV[2] = floor weight the decay stops at (number >= 0)
-- ARGV[3] = the hash expires when no node merged into it for this many ms (integer >= 1)
-- ARGV[4] = HSCAN cursor of the page of the hash to return ('' = none; '0' = the first)
-- ARGV[5], ARGV[6], ... = field, hex msgpack batch (same layout; at_ms ignored), pairs
-- returns {now_ms, {field, record, ...}, next_cursor, live_nodes}: the records this call
--   merged, then one page (about 256 fields) of the hash from the cursor; next_cursor
--   '0' when the hash was read to its end; live_nodes, the nodes holding a lease now
--   (a node merges less often in a big fleet, so the pool's merge rate stays bounded).
--   Callers send at most 32 batches (coordinator.coordinator.TIMING_STEP), so every
--   call is bounded whatever the pool size, and walk the cursor over several calls.
local T = KEYS[17]
local half = int_arg(ARGV[1])
local floor_w = tonumber(ARGV[2])
local max_age = int_arg(ARGV[3])
if not half or half < 1 then return fail('bad_arg', 'half-life must be an integer >= 1') end
if not floor_w or floor_w ~= floor_w or floor_w < 0 then
  return fail('bad_arg', 'floor weight must be a number >= 0')
end
if not max_age or max_age < 1 then return fail('bad_arg', 'max age must be an integer >= 1') end
local cursor = ARGV[4]
if cursor == nil or not valid_cursor(cursor) then
  return fail('bad_arg', 'cursor must be empty or an HSCAN cursor')
end
if #ARGV % 2 ~= 0 then return fail('bad_arg', 'batches come as field, record pairs') end

local GROUP = 6
-- Hex digit pairs <-> bytes, as lookup tables for string.gsub: a table replacement is
-- looked up in C, where a function replacement runs a Lua call per byte (that made a
-- merge 3x slower). Built once per call, on first use.
local HEX_BYTE, BYTE_HEX = nil, nil
local function hex_tables()
  HEX_BYTE, BYTE_HEX = {}, {}
  for i = 0, 255 do
    local h, c = string.format('%02x', i), string.char(i)
    HEX_BYTE[h], BYTE_HEX[c] = c, h
  end
end

local function from_hex(text)
  if type(text) ~= 'string' or #text % 2 ~= 0 then return nil end
  if not HEX_BYTE then hex_tables() end
  -- A pair that is not two lowercase hex digits has no entry and stays two characters,
  -- so the length tells whether every pair was one.
  local bytes = string.gsub(text, '..', HEX_BYTE)
  if #bytes * 2 ~= #text then return nil end
  local ok, value = pcall(cmsgpack.unpack, bytes)
  if ok then return value end
  return nil
end

local function to_hex(record)
  if not BYTE_HEX then hex_tables() end
  return (string.gsub(cmsgpack.pack(record), '.', BYTE_HEX))
end

local function record_ok(r)
  if type(r) ~= 'table' or #r < 2 + GROUP or (#r - 2) % GROUP ~= 0 then return false end
  for i = 1, #r do
    local v = r[i]
    if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge then return false end
  end
  return true
end

local batches = {}
for i = 5, #ARGV, 2 do  -- every batch is checked before anything is written
  local field = ARGV[i]
  local model = string.match(field, '^|output|(.*)$')
  if not valid_id(field) and not (model and #model <= 256 and not string.find(model, '%c')) then
    return fail('bad_arg', 'field must be an instance id or |output|<model>')
  end
  local batch = from_hex(ARGV[i + 1])
  if not record_ok(batch) then
    return fail('bad_arg', 'batch of ' .. ARGV[i] .. ' is not a timing record')
  end
  batches[#batches + 1] = batch
end

local now = now_ms()
local merged = {}
for b = 1, #batches do
  local field, batch = ARGV[3 + 2 * b], batches[b]
  local rec = from_hex(redis.call('HGET', T, field))
  if not record_ok(rec) then rec = nil end
  if rec == nil or #rec ~= #batch or batch[1] > rec[1] then
    rec = {batch[1], now}
    for j = 3, #batch do rec[j] = 0 end
  end
  if batch[1] == rec[1] then
    local decay = 1
    if now > rec[2] then decay = 2 ^ (-(now - rec[2]) / half) end
    for g = 3, #rec, GROUP do
      local w = rec[g + 1]
      local f = decay
      if w * f < floor_w then
        if w > floor_w then f = floor_w / w else f = 1 end
      end
      rec[g] = rec[g] + batch[g]
      for j = 1, GROUP - 1 do rec[g + j] = rec[g + j] * f + batch[g + j] end
    end
    rec[2] = now
    local hex = to_hex(rec)
    redis.call('HSET', T, field, hex)
    merged[#merged + 1] = field
    merged[#merged + 1] = hex
  end
end
if #ARGV > 4 then redis.call('PEXPIRE', T, max_age) end
local next_cursor = '0'
if cursor ~= '' then
  local page = redis.call('HSCAN', T, cursor, 'COUNT', 256)
  next_cursor = page[1]
  for _, v in ipairs(page[2]) do merged[#merged + 1] = v end
end
return {now, merged, next_cursor, redis.call('ZCOUNT', K_NODES, now, '+inf')}
