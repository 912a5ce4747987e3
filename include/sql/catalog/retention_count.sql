-- What retention would drop (a dry run): the snapshots of the partitions whose nights are all
-- past the horizon of catalog.popularity_drop_partition (partitions never overlap, so they are
-- the rows dated before the newest upper bound of those partitions).
WITH past AS (
    SELECT p.upper_bound FROM catalog.popularity_partitions() p
     WHERE p.upper_bound <= least(%(as_of)s::date, {common/today})
                            - (greatest(%(keep_days)s, 30) + 2)
)
SELECT count(*) FROM catalog.popularity_daily_views
 WHERE run_date < (SELECT max(upper_bound) FROM past)
