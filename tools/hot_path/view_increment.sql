-- The catalog view consumer's hot path (pgbench script, run by tools/pgbench.py): one
-- popularity_views + 1 (autocommit) on the card in row n of hot_path_row (the nhot hot cards
-- first, picked hot_pct % of the time, then nrest others), in whichever card table holds it.
\set n CASE WHEN random(1, 100) <= :hot_pct THEN random(1, :nhot) ELSE :nhot + random(1, :nrest) END
SELECT id AS card, EXISTS (SELECT FROM catalog.project_cards c WHERE c.id = r.id)::int AS project
  FROM hot_path_row r WHERE n = :n \gset
\if :project
UPDATE catalog.project_cards SET popularity_views = popularity_views + 1 WHERE id = :card;
\else
UPDATE catalog.property_object_cards SET popularity_views = popularity_views + 1 WHERE id = :card;
\endif
