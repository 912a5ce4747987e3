-- The source is a keyset source query from include/sql, never from input.
SELECT count(*) FROM ({source}) AS src
