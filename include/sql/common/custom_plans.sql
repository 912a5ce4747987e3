-- For the rest of the transaction, plan each statement for its actual parameters (SET LOCAL)
-- instead of reusing the generic plan of a prepared statement.
SELECT set_config('plan_cache_mode', 'force_custom_plan', true)
