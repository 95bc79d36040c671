-- read_specs: instance specs, epochs, capacities and slots, in bounded steps.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = since: the spec_gen the caller has applied (0 = none)
-- ARGV[2] = cursor: '' for an incremental read; for a full read '0' to start, then
--   the cursor the previous step returned
-- ARGV[3] = limit: instances per step (1..1000)
-- returns {run_id, spec_gen, mode, next, entries}
--   mode 'delta': entries of the ids changed since ARGV[1]; next = '' when caught up,
--     else the spec_gen to ask from next
--   mode 'full': ARGV[1] is 0 or predates the kept change log (or ARGV[2] asked for
--     it);
--     next = the HSCAN cursor to continue with ('0' = done)
--   entries: flat {id, spec_json|false, epoch, max_slots, slot} (false: removed)
local since = int_arg(ARGV[1])
local limit = int_arg(ARGV[3], 1000)
if since == nil or limit == nil or limit < 1 then return fail('bad_arg', 'since, limit') end
local now = now_ms()
local run = run_id(now)
local gen = num(K_META, 'spec_gen')
-- `spec`: the spec JSON when the caller has it already (HSCAN returns it), else nil.
local function entry(out, id, spec)
  spec = spec or redis.call('HGET', K_SPEC, id)
  table.insert(out, id)
  if spec then
    table.insert(out, spec)
    table.insert(out, num(K_EPOCH, id))
    table.insert(out, num(K_MAX_SLOTS, id))
    table.insert(out, num(K_SLOT, id))
  else
    table.insert(out, false)
    table.insert(out, 0)
    table.insert(out, 0)
    table.insert(out, -1)
  end
end
local out = {}
local cursor = ARGV[2] or ''
if not valid_cursor(cursor) then
  return fail('bad_arg', 'cursor must be empty or an HSCAN cursor')
end
if cursor == '' then
  local oldest = redis.call('ZRANGE', K_SPEC_LOG, 0, 0, 'WITHSCORES')
  local kept_from = #oldest > 0 and tonumber(oldest[2]) or gen + 1
  if since == 0 or since > gen or since + 1 < kept_from then
    -- Nothing held yet, or the log no longer covers the gap: read every current spec
    -- (a new node never walks the log's removed ids).
    cursor = '0'
  else
    local ids = redis.call('ZRANGEBYSCORE', K_SPEC_LOG, '(' .. since, '+inf', 'WITHSCORES',
      'LIMIT', 0, limit)
    local last = gen
    for i = 1, #ids, 2 do entry(out, ids[i]) end
    if #ids == 2 * limit then last = tonumber(ids[#ids]) end
    return {run, gen, 'delta', last == gen and '' or tostring(last), out}
  end
end
local step = redis.call('HSCAN', K_SPEC, cursor, 'COUNT', limit)
for i = 1, #step[2], 2 do entry(out, step[2][i], step[2][i + 1]) end
return {run, gen, 'full', step[1], out}
