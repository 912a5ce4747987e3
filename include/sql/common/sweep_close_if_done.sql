-- Close the sweep when all its ranges are done.
UPDATE pin_nightly.sweep s
   SET status = 'done', completed_at = clock_timestamp()
 WHERE s.sweep_id = %(sweep_id)s AND s.status = 'open'
   AND NOT EXISTS (SELECT 1 FROM pin_nightly.sweep_range r
                    WHERE r.sweep_id = s.sweep_id AND r.status <> 'done')
RETURNING status
