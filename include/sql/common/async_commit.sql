-- Batch transactions commit without waiting for their WAL flush (SET LOCAL). A server crash can
-- lose the last few committed batches -- their corrections and their cursor moves together,
-- since WAL is replayed in order -- and the next run redoes them from the checkpoint it finds:
-- the recount is absolute and the snapshot upsert idempotent. A run's totals are read back from
-- the range rows, so they never count a lost batch.
SELECT set_config('synchronous_commit', 'off', true)
