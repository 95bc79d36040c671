-- restore: re-assert a node's live reservation after Redis lost or missed it.
-- Idempotent: an existing record is only advanced (prefill -> decode), never doubled.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- KEYS[17] = {pool}:node:<node>:rids  the owning node's reservation set
-- ARGV[1] = rid
-- ARGV[2] = node id (must hold a live lease: the caller renews it first)
-- ARGV[3] = instance id (used only when Redis holds no record of the rid)
-- ARGV[4] = epoch the reservation was made under
-- ARGV[5] = phase ('prefill' or 'decode')
-- ARGV[6] = prompt_tokens, ARGV[7] = expected_output_tokens
-- ARGV[8] = prefill_ms (ms, <= 86400000), ARGV[9] = decode_ms (ms, <= 86400000)
-- returns {'restored'|'advanced'|'exists', instance, epoch} | {'void'} | {'unknown'}
--       | {'nolease'}
--   restored: recreated on ARGV[3]; advanced/exists: Redis already held the rid, on
--     the instance and epoch it recorded (the caller adopts them: a reply lost
--     after a reserve leaves the record where the script put it)
--   void: the instance runs another epoch; the caller forgets the reservation
--   unknown: the instance is not registered (yet); the caller may register it, retry
--   nolease: the node's lease expired (and may have been reaped): renew, start over
local rid, node, id = ARGV[1], ARGV[2], ARGV[3]
if not valid_id(rid) or not valid_id(node) or not valid_id(id) then
  return fail('bad_arg', 'rid, node and instance must be ids')
end
local epoch, phase = int_arg(ARGV[4]), ARGV[5]
local prompt, expected = int_arg(ARGV[6]), int_arg(ARGV[7])
local prefill_ms = int_arg(ARGV[8], MAX_PREDICTED_MS)
local decode_ms = int_arg(ARGV[9], MAX_PREDICTED_MS)
if epoch == nil or prompt == nil or expected == nil or prefill_ms == nil or decode_ms == nil
    or (phase ~= 'prefill' and phase ~= 'decode') then
  return fail('bad_arg', 'restore arguments')
end
local now = now_ms()
-- Written only under a live lease, so the reaper always finds what this wrote.
if not lease_held(node, now) then return {'nolease'} end
local raw = redis.call('HGET', K_RES, rid)
if raw then
  redis.call('SADD', KEYS[17], rid)  -- a set lost or edited by hand holds it again
  local rec = cjson.decode(raw)
  if rec.phase == 'prefill' and phase == 'decode' then
    first_token(rid, now)
    commit_state()
    return {'advanced', rec.instance, rec.epoch}
  end
  return {'exists', rec.instance, rec.epoch}
end
local stored_epoch = redis.call('HGET', K_EPOCH, id)
if not stored_epoch then return {'unknown'} end
if tonumber(stored_epoch) ~= epoch then return {'void'} end
local st = slot_state(id)
if not st then return {'unknown'} end
local rec = {instance = id, epoch = epoch, node = node, phase = phase, prompt_tokens = prompt,
  expected_output_tokens = expected, prefill_ms = prefill_ms, decode_ms = decode_ms,
  created_ms = now, predicted_ttft_ms = 0, slot = st.slot}
if phase == 'prefill' then
  rec.first_token_at_ms = math.max(now, st.free_at) + prefill_ms
  rec.end_at_ms = rec.first_token_at_ms + decode_ms
  st.pending, st.pending_ms = st.pending + 1, st.pending_ms + prefill_ms
  st.free_at = rec.first_token_at_ms
else
  rec.first_token_at_ms = now
  rec.end_at_ms = now + decode_ms
  st.decode = st.decode + 1
end
redis.call('HSET', K_RES, rid, encode_record(rec))
redis.call('ZADD', K_BY_INSTANCE, '0', lex_member(id, epoch, rec.end_at_ms, rid))
redis.call('SADD', KEYS[17], rid)
earliest_joined(st, rec.end_at_ms)
write_state(st)
commit_state()
return {'restored', id, epoch}
