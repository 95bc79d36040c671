-- mark_first_token: move a reservation from prefill to decode (idempotent by rid).
-- KEYS[1..16] = the pool columns (coordinator/keys.py COLUMNS)
-- ARGV[1] = rid
-- ARGV[2] = since: pool version for the piggybacked delta
-- ARGV[3] = run_id the caller last saw
-- returns {'ok'|'noop', delta}   noop: unknown rid, or already in decode
if not valid_id(ARGV[1]) then return fail('bad_arg', 'rid') end
local since = int_arg(ARGV[2])
if since == nil then return fail('bad_arg', 'since') end
local now = now_ms()
local raw = redis.call('HGET', K_RES, ARGV[1])
if not raw then return {'noop', delta(since, ARGV[3], now)} end
local rec = cjson.decode(raw)
if rec.phase ~= 'prefill' then return {'noop', delta(since, ARGV[3], now)} end
local id = rec.instance
redis.call('ZREM', K_BY_INSTANCE, lex_member(id, rec.end_at_ms, ARGV[1]))
rec.phase = 'decode'
rec.first_token_at_ms = now
rec.end_at_ms = now + rec.decode_ms
redis.call('HSET', K_RES, ARGV[1], cjson.encode(rec))
redis.call('ZADD', K_BY_INSTANCE, 0, lex_member(id, rec.end_at_ms, ARGV[1]))
if tonumber(redis.call('HGET', K_EPOCH, id) or '-1') == rec.epoch then
  if num(K_PENDING, id) > 0 then redis.call('HINCRBY', K_PENDING, id, -1) end
  redis.call('HINCRBY', K_DECODE, id, 1)
  redis.call('HINCRBY', K_PENDING_MS, id, 0 - rec.prefill_ms)  -- never '-0': Redis rejects it
  rechain_after_first_token(id, now)
  touch(id, now)
end
return {'ok', delta(since, ARGV[3], now)}
