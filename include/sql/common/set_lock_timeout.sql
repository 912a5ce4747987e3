-- For the rest of the transaction: give up waiting for a row lock after this many milliseconds.
SELECT set_config('lock_timeout', %(ms)s, true)
