-- The corrections recorded in news_drift (no dry run) in a summary's windows, (since, through]:
-- since the previous summary of any run (the counter), since the previous nightly summary and
-- outside targeted repairs (the nightly drift gauge and its alert), and since the acquisition
-- began (a manual run's own alert). Counted from what was durably written, a correction made by
-- a run that died before its summary is counted by the next summary.
SELECT count(*) FILTER (WHERE d.recorded_at > %(since_any)s)                  AS corrected,
       count(*) FILTER (WHERE d.recorded_at > %(since_nightly)s
                          AND s.family IS DISTINCT FROM 'Targeted')            AS nightly,
       count(*) FILTER (WHERE d.recorded_at > %(acquired_at)s::timestamptz)   AS own
  FROM pin_nightly.news_drift d
  LEFT JOIN pin_nightly.sweep s ON s.sweep_id = d.sweep_id
 WHERE NOT d.dry_run
   AND d.recorded_at > least(%(since_any)s, %(since_nightly)s, %(acquired_at)s::timestamptz)
   AND d.recorded_at <= %(through)s
