-- reserve: claim the first ranked candidate that is no busier than the caller saw it,
-- and not beaten now by one before it that was (fewer reservations, and a TTFT no
-- longer) (or, when its prefill got busier: of those with no more reservations than
-- their bounds, the one that starts this request's prefill soonest; when every one
-- has more: the least busy if it is at or below the pool's mean).
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the calling node's reservation set
-- ARGV[1] = rid (request id, [A-Za-z0-9._:-], <= 128 chars)
-- ARGV[2] = node id
-- ARGV[3] = prompt_tokens (integer >= 0)
-- ARGV[4] = expected_output_tokens (integer >= 0)
-- ARGV[5] = force (1 = take the least-reserved alive candidate, whatever was observed)
-- ARGV[6] = enforce_slots (1 = skip candidates at max_slots)
-- ARGV[7] = instance ttl in ms (alive while now - last_seen <= ttl)
-- ARGV[8] = lease_ms: 0 when the node believes it holds a lease (it must: a node
--   whose lease expired may have been reaped and must re-assert first); > 0 when the
--   node never held one: a missing lease is then created with this length (ms)
-- ARGV[9] = the caller's view: '<run_id>:<state_ver>' of the `state` it holds, or '';
--   prefixed '~' when the caller ranks a random sample (its view is a change per
--   instance behind) and its `state` is large: a refusal then brings no state
-- ARGV[10] = n, the number of candidates
-- ARGV[11] = ties: the first `ties` candidates tie for best in the caller's ranking.
--   The walk visits them in slot order, from the first slot after the one the pool's
--   last reservation with ties took (meta tie_last), wrapping round, then the rest as
--   ranked: the fleet's nodes take tied instances in one turn round the pool, not each
--   by a rotation of its own that the others' collide with. 0 or 1: no ties. The
--   order uses the slots the candidates' bounds carry, read here only when one is not
--   known (a stale one changes only whose turn it is).
-- ARGV[12] = '<run_id>:<spec_gen>': the pool run and spec_gen the caller's slots were
--   read at, or ''. When they are the pool's, no slot changed hands since (only a
--   registration or an unregistration moves a slot, and each bumps spec_gen), so the
--   slots sent are the instances' slots: the walk reads no `slot` hash. Otherwise each
--   visited candidate's slot is looked up.
-- ARGV[13 ..] = n pairs {instance id, bounds}: bounds is 23 base-128 digits
--   (coordinator/packed.py pack_candidate): the instance's slot as the caller has it
--   (3; 2097151 = not known), prefill_ms (4) and decode_ms (4) (ms, <= 86400000), max
--   inflight (3), max pending_prefill (3), max prefill_free_at (6): the most live
--   reservations (both phases) and prefill-phase reservations the candidate may have
--   now, and the latest its prefill may be busy until (Redis ms; 0 = no bound; an
--   instance whose prefill is free now always passes), and still be taken. The
--   caller sends what it observed, raised to the least it observed on any candidate
--   ranked after this one, or for a tied one on any other of the tie (the walk may
--   visit it first) (coordinator/guard.py: so a candidate is still taken while
--   it is no busier, and would start this request's prefill no later, than the
--   alternatives the caller knows: a stale view costs no retry as long as its order
--   holds). Packed, so the walk parses no number: a group is checked only when the
--   script looks at its candidate.
-- ARGV[13 + 2n] (optional) = m (<= 64), then m pairs {'f' | 'r', rid}: first-token marks and
--   releases of this node's reservations that ride along with this call (the node
--   holds them back a few ms for its next reserve, so a request costs one call, not
--   three). They are applied in order, whatever this call's status: after it decided
--   (which reads the state the caller's view also predates them in) and before its
--   own writes. A release of ARGV[1] itself (a retry elsewhere under the same rid)
--   makes the rid new again instead of a 'dup'.
-- then (optional, after the transitions) r, then r prefix records of earlier requests
--   (lua/_lib.lua carried_records), applied after the transitions, whatever this call's
--   status; KEYS[18] = {pool}:prefix_index when r > 0
-- returns {'ok'|'dup', instance, epoch, predicted_ttft_ms, prefill_ms, decode_ms,
--          carried, view}
--       | {'nolease', carried, view}  ARGV[8] = 0 and the node's lease is gone
--       | {'stale', carried, view}    every candidate has more reservations than its
--                                     bounds, and the least busy has more live reservations
--                                     than the pool's mean (meta inflight_total over
--                                     the registered instances)
--       | {'full', next_slot_in_ms, carried, view}  every alive candidate is at max_slots
--       | {'none', carried, view}     no candidate is registered and alive
--   carried = the carried transitions' replies, 4 items each: {status ('ok'|'noop'),
--     state_ver, slot, record} (mark_first_token's and release's reply; state_ver -1
--     when no counter moved), then each carried record's count (the instance's blocks
--     in the index after it)
--   view = {run_id, spec_gen, now_ms, state|false, false, state_ver, slot, record}
--   (read_state's reply without liveness, plus one record):
--   - 'ok': state is false; `record` is the claimed instance's new record at `slot`,
--     which took `state` to state_ver (the caller's view reaches state_ver only
--     when it was at state_ver - 1: a view behind catches up by itself, at a rate
--     the caller bounds, not in every reply);
--   - any other status: the whole `state` at state_ver, so the caller decides again
--     on fresh rows; or false (slot -1) when ARGV[9] names the pool's state_ver
--     or starts with '~' (the caller's next sample reads fresh counters here anyway,
--     and its whole reads go outside Lua: read_state),
--     since the caller holds it already
local rid, node = ARGV[1], ARGV[2]
if not valid_id(rid) then return fail('bad_arg', 'rid') end
if not valid_id(node) then return fail('bad_arg', 'node') end
local prompt = int_arg(ARGV[3], 10000000)
if prompt == nil then return fail('bad_arg', 'prompt_tokens must be an integer >= 0') end
local expected = int_arg(ARGV[4], 10000000)
if expected == nil then return fail('bad_arg', 'expected_output_tokens must be an integer >= 0') end
local force, enforce = ARGV[5] == '1', ARGV[6] == '1'
local ttl = int_arg(ARGV[7])
if ttl == nil then return fail('bad_arg', 'ttl_ms') end
local lease_ms = int_arg(ARGV[8], 86400000)
if lease_ms == nil then return fail('bad_arg', 'lease_ms') end
local n = int_arg(ARGV[10], 64)
if n == nil or n < 1 or #ARGV < 12 + 2 * n then
  return fail('bad_arg', 'candidates: expected n >= 1 pairs of {id, bounds}')
end
local ties = int_arg(ARGV[11], n)
if ties == nil then return fail('bad_arg', 'ties must be an integer in 0..n') end
local G = 12  -- candidate i's pair is ARGV[G + 2i - 1], ARGV[G + 2i]
local BOUNDS_BYTES, NO_SLOT = 23, 2097151

-- Candidate i's bounds: slot (nil when not known), prefill_ms, decode_ms, max
-- inflight, max pending and max free-at; or nothing when they are not valid. The id
-- needs no pattern check: one that is not registered is never alive, so never chosen
-- or written.
local function bounds(i)
  local raw = ARGV[G + 2 * i]
  if #raw ~= BOUNDS_BYTES then return end
  local s1, s2, s3, p1, p2, p3, p4, d1, d2, d3, d4, i1, i2, i3, q1, q2, q3,
    f1, f2, f3, f4, f5, f6 = string.byte(raw, 1, BOUNDS_BYTES)
  if math.max(s1, s2, s3, p1, p2, p3, p4, d1, d2, d3, d4, i1, i2, i3, q1, q2, q3,
      f1, f2, f3, f4, f5, f6) > 127 then
    return
  end
  local prefill_ms = ((p1 * 128 + p2) * 128 + p3) * 128 + p4
  local decode_ms = ((d1 * 128 + d2) * 128 + d3) * 128 + d4
  if prefill_ms > MAX_PREDICTED_MS or decode_ms > MAX_PREDICTED_MS then return end
  local slot = (s1 * 128 + s2) * 128 + s3
  if slot == NO_SLOT then slot = nil end
  return slot, prefill_ms, decode_ms, (i1 * 128 + i2) * 128 + i3, (q1 * 128 + q2) * 128 + q3,
    ((((f1 * 128 + f2) * 128 + f3) * 128 + f4) * 128 + f5) * 128 + f6
end

local function sent_slot(i)
  local s1, s2, s3 = string.byte(ARGV[G + 2 * i], 1, 3)
  local slot = s1 and s3 and (s1 * 128 + s2) * 128 + s3
  if slot == NO_SLOT then return nil end
  return slot
end

-- The slots sent are the instances' own when the caller read them at this pool run
-- and spec_gen.
local p0 = pool_counts()
local trusted = ARGV[12] ~= '' and p0.run and ARGV[12] == p0.run .. ':' .. p0.spec_gen

-- The order the walk visits the candidates in: the tied ones by slot from the first
-- after tie_last (wrapping round), then the rest as ranked. With a tie and a slot not
-- sent, every candidate's slot is read here, once (false: not registered).
local order, slots = {}, nil
if ties >= 2 then
  local tied, slot_of, unknown = {}, {}, false
  for i = 1, ties do
    tied[i] = i
    slot_of[i] = sent_slot(i)
    if slot_of[i] == nil then unknown = true end
  end
  if unknown then
    local ids = {}
    for i = 1, n do ids[i] = ARGV[G + 2 * i - 1] end
    slots = redis.call('HMGET', K_SLOT, unpack(ids))
    -- Each slot as a number once: a string's tonumber costs more than the whole sort.
    for i = 1, n do slots[i] = tonumber(slots[i]) or false end
    for i = 1, ties do slot_of[i] = slots[i] or -1 end
  end
  local ascending = true
  for i = 2, ties do
    if slot_of[i] < slot_of[i - 1] then ascending = false break end
  end
  if not ascending then
    table.sort(tied, function(a, b)
      local sa, sb = slot_of[a], slot_of[b]
      if sa ~= sb then return sa < sb end
      return a < b
    end)
  end
  local last, start = p0.tie_last, 1
  for k = 1, ties do
    if slot_of[tied[k]] > last then start = k break end
  end
  for k = 0, ties - 1 do order[k + 1] = tied[(start - 1 + k) % ties + 1] end
end
for i = #order + 1, n do order[i] = i end

-- Candidate i's slot (a number, or false when it has none) and max_slots (false when
-- missing or not enforced): the slot sent when trusted, else Redis's (read above for
-- ties, else by one HGET for the first candidate visited and, when the walk passes it
-- over, one HMGET for all the others). Passing the first candidate over, the walk
-- reads the others' `state` records in one GETRANGE when they lie close together (a
-- view many changes behind visits most of them).
local looked, looked_at = nil, {}
local PREFETCH_BYTES = 4096  -- the whole state of a pool of up to 170 instances
local function located(i, slot)
  local id = ARGV[G + 2 * i - 1]
  if not trusted or not slot then
    slot = nil
    if slots then slot = slots[i] end
  end
  if i == order[1] then
    if slot == nil then slot = tonumber(redis.call('HGET', K_SLOT, id)) or false end
    return slot, enforce and redis.call('HGET', K_MAX_SLOTS, id)
  end
  if not looked then
    local ids, lookup, near = {}, false, {}
    for k = 2, n do
      local j = order[k]
      ids[k - 1] = ARGV[G + 2 * j - 1]
      looked_at[j] = k - 1
      local s = slots and slots[j]
      if trusted and s == nil then s = sent_slot(j) end
      if s == nil then lookup = true end
      near[k - 1] = s or nil
    end
    looked = {lookup and redis.call('HMGET', K_SLOT, unpack(ids)),
      enforce and redis.call('HMGET', K_MAX_SLOTS, unpack(ids)) or {}}
    if lookup then
      for k = 1, n - 1 do near[k] = near[k] or tonumber(looked[1][k]) end
    end
    prefetch_states(near, PREFETCH_BYTES)
  end
  local at = looked_at[i]
  if slot == nil then slot = tonumber(looked[1][at]) or false end
  return slot, looked[2][at]
end

-- Whether the instance at slot `slot` is alive: the last_seen of its `live` record
-- (0 when it has none) within the ttl. Read only for a candidate the walk may keep.
local function alive(slot, since)
  local at = slot * LIVE_BYTES
  local a, b, c, d, e, f = string.byte(redis.call('GETRANGE', K_LIVE, at, at + 5), 1, 6)
  if not f then return false end
  local seen = ((((a * 128 + b) * 128 + c) * 128 + d) * 128 + e) * 128 + f
  return seen > 0 and seen >= since
end

-- A candidate the walk keeps (the least busy so far, or the soonest start): its
-- index, slot, predictions, live reservations and state fields (adopt_state's order).
local function kept_candidate(i, slot, prefill_ms, decode_ms, pending, decode, free_at,
    earliest, pending_ms, started)
  return {i = i, slot = slot, prefill_ms = prefill_ms, decode_ms = decode_ms,
    inflight = pending + decode,
    state = {pending, decode, free_at, earliest, pending_ms, started}}
end

local m, records = 0, {}
if #ARGV > G + 2 * n then
  m, records = carried_count(G + 2 * n + 1)
  if m == nil then return records end  -- the error reply
end

-- Decide first, writing nothing (so that a refused call writes nothing).
local now = now_ms()
-- Reservations are written only under a live lease: the reaper finds a node through
-- its lease, so a reservation without one would never go away.
local leased = lease_held(node, now)
local chosen, chosen_st = nil, nil
local saw_alive, saw_full, min_slot_ms = false, false, nil
-- A retry elsewhere reserves again under the rid its carried release ends.
local rid_released = false
for i = 1, m do
  local at = G + 2 * n + 1 + 2 * i
  if ARGV[at - 1] == 'r' and ARGV[at] == rid then rid_released = true end
end
if leased or lease_ms > 0 then
  -- Unforced: the first alive candidate within its bounds that no candidate visited
  -- before it and over its count bounds beats now (see `dominated`), unless one
  -- visited before it, within its count bounds but busy past its free-at bound, would
  -- still start this request's prefill sooner: of the candidates within their count
  -- bounds and not beaten so, up to the first within all its bounds (all of them when
  -- none is), the one whose prefill starts soonest now, first on ties. (Skipping a
  -- candidate for its free-at alone would take a later one whose own bounds were
  -- raised to what the node saw of the candidates after it, which may be busier
  -- still.) Forced (the last try): the alive candidate with the fewest live
  -- reservations now, first on ties. With none such: the one with the fewest live
  -- reservations now, when it has no more than the pool's mean (taking it cannot make
  -- it the busiest). A view many changes behind then costs no second call.
  local least, timed, timed_ttft = nil, nil, nil
  local alive_since = now - ttl
  -- The candidates passed over for their counts: {inflight, ttft, slot, alive}.
  local overs = {}
  -- Whether one passed over for its counts, and alive, has fewer live reservations
  -- than a candidate with these and would give this request a TTFT no longer. The
  -- caller's bounds compare a candidate only with those ranked after it, so a view
  -- behind on both would otherwise take it over one it ranked first that is better
  -- now. (Fewer reservations alone is not better: the less busy one may have a long
  -- prefill queued.)
  local function dominated(inflight, ttft)
    for _, o in ipairs(overs) do
      if o[1] < inflight and o[2] <= ttft then
        if o[4] == nil then o[4] = alive(o[3], alive_since) end
        if o[4] then return true end
      end
    end
    return false
  end
  for _, i in ipairs(order) do
    local sent, prefill_ms, decode_ms, max_inflight, max_pending, max_free_at = bounds(i)
    if prefill_ms == nil then return fail('bad_arg', 'candidate ' .. i) end
    local slot, max_slots = located(i, sent)
    if slot then
      local pending, decode, free_at, earliest, pending_ms, started = state_fields(slot)
      local inflight = pending + decode
      max_slots = enforce and tonumber(max_slots or '0') or 0
      local full = max_slots > 0 and inflight >= max_slots
      local lesser = not full and (least == nil or inflight < least.inflight)
      local within = not full and not force and inflight <= max_inflight
        and pending <= max_pending
      local ttft = math.max(now, free_at) + prefill_ms
      local fits = within and (#overs == 0 or not dominated(inflight, ttft))
      local over = nil
      if not full and not force and not within then
        over = {inflight, ttft, slot}
        overs[#overs + 1] = over
      end
      -- Liveness matters only to a candidate the walk would keep, or count as full: a
      -- passed-over one costs no read of it (the first alive one is always kept, so
      -- saw_alive comes out the same), unless it turns out to beat one within its
      -- bounds.
      local live = (full or lesser or fits) and alive(slot, alive_since)
      if over and lesser then over[4] = live end
      if live then
        saw_alive = true
        if full then
          saw_full = true
          local wait = earliest > 0 and math.max(0, earliest - now) or 0
          if min_slot_ms == nil or wait < min_slot_ms then min_slot_ms = wait end
        else
          -- A table only for a candidate the walk keeps (most are passed over).
          local kept = nil
          if lesser then
            kept = kept_candidate(i, slot, prefill_ms, decode_ms, pending, decode, free_at,
              earliest, pending_ms, started)
            least = kept
          end
          if fits then
            if timed == nil or ttft < timed_ttft then
              timed = kept or kept_candidate(i, slot, prefill_ms, decode_ms, pending, decode,
                free_at, earliest, pending_ms, started)
              timed_ttft = ttft
            end
            if max_free_at == 0 or free_at <= math.max(now, max_free_at) then break end
          end
        end
      end
    end
  end
  if force then
    chosen = least
  elseif timed ~= nil then
    chosen = timed
  elseif least ~= nil
      and least.inflight * redis.call('HLEN', K_SLOT) <= pool_counts().total then
    chosen = least
  end
  if chosen then
    -- This call's copy of its state from here on: carried transitions change it too.
    chosen.id = ARGV[G + 2 * chosen.i - 1]
    chosen_st = adopt_state(chosen.id, chosen.slot, unpack(chosen.state))
  end
end

-- Then write: the carried transitions first, whatever the status.
local carried, bumps = apply_carried(G + 2 * n + 1, m, records, KEYS[17], now)
local run = pool_counts().run or run_id(now)
local spec_gen = pool_counts().spec_gen
local function view(patch)
  commit_state()
  if patch then return {run, spec_gen, now, false, false, patch[1], patch[2], patch[3]} end
  local state_ver = pool_counts().ver
  -- The caller holds this state already (it applies the carried changes itself).
  local token = ARGV[9]
  local lean = string.byte(token, 1) == 126  -- '~'
  if lean then token = string.sub(token, 2) end
  if lean or token == run .. ':' .. (state_ver - bumps) then
    return {run, spec_gen, now, false, false, state_ver, -1, ''}
  end
  return {run, spec_gen, now, redis.call('GET', K_STATE) or '', false, state_ver, -1, ''}
end
if not leased and lease_ms == 0 then return {'nolease', carried, view()} end
-- A rid Redis holds already (a reserve sent again after its reply was lost): where
-- the first one went. Checked when writing (HSETNX), or here when nothing was chosen.
local function dup(existing)
  local rec = cjson.decode(existing)
  return {'dup', rec.instance, rec.epoch, rec.predicted_ttft_ms, rec.prefill_ms, rec.decode_ms,
    carried, view()}
end
if not chosen then
  local existing = not rid_released and redis.call('HGET', K_RES, rid)
  if existing then return dup(existing) end
  local d = view()
  if saw_full then return {'full', min_slot_ms or 0, carried, d} end
  if saw_alive then return {'stale', carried, d} end
  return {'none', carried, d}
end

local id, st = chosen.id, chosen_st
local epoch = num(K_EPOCH, id)
local first_token_at = math.max(now, st.free_at) + chosen.prefill_ms
local end_at = first_token_at + chosen.decode_ms
local ttft = first_token_at - now
-- The record first: HSETNX is the duplicate check (a carried release of this rid
-- deleted its record above).
local created = redis.call('HSETNX', K_RES, rid, encode_record({instance = id, epoch = epoch,
  node = node, phase = 'prefill', prompt_tokens = prompt, expected_output_tokens = expected,
  prefill_ms = chosen.prefill_ms, decode_ms = chosen.decode_ms, created_ms = now,
  first_token_at_ms = first_token_at, end_at_ms = end_at, predicted_ttft_ms = ttft,
  slot = st.slot}))
if created == 0 then return dup(redis.call('HGET', K_RES, rid)) end
if not leased then redis.call('ZADD', K_NODES, now + lease_ms, node) end
redis.call('ZADD', K_BY_INSTANCE, '0', lex_member(id, epoch, end_at, rid))
redis.call('SADD', KEYS[17], rid)
st.pending, st.pending_ms, st.free_at = st.pending + 1, st.pending_ms + chosen.prefill_ms, first_token_at
st.started = st.started + 1
earliest_joined(st, end_at)
if ties >= 2 then
  local p = pool_counts()
  p.tie_last, p.turned = st.slot, true
end
return {'ok', id, epoch, ttft, chosen.prefill_ms, chosen.decode_ms, carried, view(write_state(st))}
