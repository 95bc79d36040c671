-- sweep: delete void reservation records (older epochs, unregistered instances) in
-- one bounded step; the lease loop calls it while renew_lease reports work left.
-- KEYS[1..16] = the pool keys (coordinator/keys.py COLUMNS)
-- ARGV[1] = budget: records to delete at most (1..5000)
-- returns {deleted, instances_left}
local budget = int_arg(ARGV[1], 5000)
if budget == nil or budget < 1 then return fail('bad_arg', 'budget') end
return sweep(budget)
