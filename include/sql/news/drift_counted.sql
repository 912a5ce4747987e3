-- The corrections recorded in news_drift (no dry run) in a summary's windows, (since, through]:
-- since the previous summary of any run (the counters), since the previous nightly summary and
-- outside targeted repairs (the nightly drift gauges and the alert), and since the acquisition
-- began (a manual run's own alert). Counted from what was durably written, a correction made by
-- a run that died before its summary is counted by the next summary. Each window is also counted
-- by direction: up, the stored count was too low (the hot path lost increments); down, it was
-- too high (the hot path counted twice). A correction always changes the count.
SELECT count(*) FILTER (WHERE d.recorded_at > %(since_any)s)                  AS corrected,
       count(*) FILTER (WHERE d.recorded_at > %(since_any)s
                          AND d.count_to > d.count_from)                       AS corrected_up,
       count(*) FILTER (WHERE d.recorded_at > %(since_any)s
                          AND d.count_to < d.count_from)                       AS corrected_down,
       count(*) FILTER (WHERE d.recorded_at > %(since_nightly)s
                          AND s.family IS DISTINCT FROM 'Targeted')            AS nightly,
       count(*) FILTER (WHERE d.recorded_at > %(since_nightly)s
                          AND s.family IS DISTINCT FROM 'Targeted'
                          AND d.count_to > d.count_from)                       AS nightly_up,
       count(*) FILTER (WHERE d.recorded_at > %(since_nightly)s
                          AND s.family IS DISTINCT FROM 'Targeted'
                          AND d.count_to < d.count_from)                       AS nightly_down,
       count(*) FILTER (WHERE d.recorded_at > %(acquired_at)s::timestamptz)   AS own
  FROM pin_nightly.news_drift d
  LEFT JOIN pin_nightly.sweep s ON s.sweep_id = d.sweep_id
 WHERE NOT d.dry_run
   AND d.recorded_at > least(%(since_any)s, %(since_nightly)s, %(acquired_at)s::timestamptz)
   AND d.recorded_at <= %(through)s
