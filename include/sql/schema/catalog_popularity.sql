-- Job-owned table of catalog_popularity_recompute: daily snapshots of the cumulative view
-- counters, partitioned by run_date, one partition per night (docs/schema.md says why).
-- Idempotent: a DBA applies it (then roles.sql); the DAG applies it when the table is absent.
-- A table of the previous release (not partitioned) is upgraded in place by a DBA's command
-- (python -m pin_nightly.partitions); the job writes to it as it is until then.
--
-- The logical contract is unchanged: the table's name and columns, one snapshot per card a
-- night (ix_popularity_daily_unique), the window index; each is a partitioned index. A
-- partitioned table's primary key must hold the partition key: (id, run_date), id a uuid v7.
-- The CHECK constraints are named as the previous release's (generated) names were, so that
-- its table attaches as a partition. There is no DEFAULT partition: the job creates each
-- night's partition ahead (catalog.popularity_ensure_partitions) and retention drops whole
-- partitions past its horizon (catalog.popularity_drop_partition).
CREATE SCHEMA IF NOT EXISTS catalog;
CREATE TABLE IF NOT EXISTS catalog.popularity_daily_views (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    card_kind        varchar(16) NOT NULL
        CONSTRAINT popularity_daily_views_card_kind_check
        CHECK (card_kind IN ('PropertyObject', 'Project')),
    card_id          uuid        NOT NULL,
    run_date         date        NOT NULL,
    cumulative_views bigint      NOT NULL
        CONSTRAINT popularity_daily_views_cumulative_views_check CHECK (cumulative_views >= 0),
    created_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT popularity_daily_views_pkey PRIMARY KEY (id, run_date)
) PARTITION BY RANGE (run_date);
CREATE UNIQUE INDEX IF NOT EXISTS ix_popularity_daily_unique
    ON catalog.popularity_daily_views (card_kind, card_id, run_date);
CREATE INDEX IF NOT EXISTS ix_popularity_daily_window
    ON catalog.popularity_daily_views (card_kind, card_id, run_date DESC);
-- The backfill guard reads max(run_date): one backward index-only step per partition.
CREATE INDEX IF NOT EXISTS ix_popularity_daily_run_date
    ON catalog.popularity_daily_views (run_date);

-- The partitions of the snapshot table and the dates each holds, [lower_bound, upper_bound).
-- Readable by anyone who may read the catalog (bounds only, no data).
CREATE OR REPLACE FUNCTION catalog.popularity_partitions()
RETURNS TABLE (partition_name text, lower_bound date, upper_bound date)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $fn$
    SELECT c.oid::regclass::text,
           substring(b FROM 'FROM \(''([0-9-]+)''\)')::date,
           substring(b FROM 'TO \(''([0-9-]+)''\)')::date
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid,
           pg_get_expr(c.relpartbound, c.oid) AS b
     WHERE i.inhparent = to_regclass('catalog.popularity_daily_views')
     ORDER BY 2
$fn$;

-- Create the missing one-night partitions of p_from .. p_through (at most 63 nights, none
-- later than 62 days after the database's current date, UTC: a bound, so the real date, never
-- earlier than the job's clock, include/sql/common/today.sql): a night already inside a
-- partition (the migrated table's range) gets none. Each partition is created apart and then
-- attached, which takes SHARE UPDATE EXCLUSIVE on the parent (never blocks the job's own
-- writes; no other session reads the table). Returns the partitions created.
-- SECURITY DEFINER: the owner of the table creates them; EXECUTE only for pin_catalog_job
-- (roles.sql).
CREATE OR REPLACE FUNCTION catalog.popularity_ensure_partitions(p_from date, p_through date)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    d date;
    part text;
    made integer := 0;
BEGIN
    IF p_from IS NULL OR p_through IS NULL OR p_through < p_from OR p_through - p_from > 62
       OR p_through > today + 62 THEN
        RAISE EXCEPTION 'popularity partitions for % .. % refused: at most 63 nights, none '
                        'later than 62 days after today (%)', p_from, p_through, today
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    d := p_from;
    WHILE d <= p_through LOOP
        IF NOT EXISTS (SELECT 1 FROM catalog.popularity_partitions() p
                        WHERE d >= p.lower_bound AND d < p.upper_bound) THEN
            part := 'popularity_daily_views_p' || to_char(d, 'YYYYMMDD');
            EXECUTE format('CREATE TABLE catalog.%I (LIKE catalog.popularity_daily_views '
                           'INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', part);
            EXECUTE format('ALTER TABLE catalog.%I ADD CONSTRAINT %I CHECK (run_date = %L)',
                           part, part || '_night', d);
            EXECUTE format('ALTER TABLE catalog.popularity_daily_views ATTACH PARTITION '
                           'catalog.%I FOR VALUES FROM (%L) TO (%L)', part, d, d + 1);
            made := made + 1;
        END IF;
        d := d + 1;
    END LOOP;
    RETURN made;
END
$fn$;

-- Retention: detach and drop the oldest partition whose nights are all past the horizon
-- least(p_as_of, today) - (greatest(p_keep_days, 30) + 2) -- the nightly window is never
-- less than 30 days, so no caller can drop a night a later run reads -- and return it with
-- the snapshots it held; no row when none is past the horizon. One partition a call: each
-- drop is its own short transaction. The concurrent form of DETACH cannot run inside a
-- function (nor a transaction): the plain DETACH and DROP take ACCESS EXCLUSIVE on the parent
-- for a moment, bounded by the caller's lock_timeout; only the job reads the table.
-- SECURITY DEFINER as above.
CREATE OR REPLACE FUNCTION catalog.popularity_drop_partition(p_as_of date, p_keep_days integer)
RETURNS TABLE (partition_name text, lower_bound date, upper_bound date, snapshots bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    horizon date := least(p_as_of, (now() AT TIME ZONE 'UTC')::date)
                    - (greatest(coalesce(p_keep_days, 30), 30) + 2);
    p record;
    n bigint;
BEGIN
    SELECT * INTO p FROM catalog.popularity_partitions() x
     WHERE x.upper_bound <= horizon ORDER BY x.lower_bound LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    EXECUTE format('SELECT count(*) FROM %s', p.partition_name) INTO n;
    EXECUTE format('ALTER TABLE catalog.popularity_daily_views DETACH PARTITION %s',
                   p.partition_name);
    EXECUTE format('DROP TABLE %s', p.partition_name);
    partition_name := p.partition_name;
    lower_bound := p.lower_bound;
    upper_bound := p.upper_bound;
    snapshots := n;
    RETURN NEXT;
END
$fn$;

REVOKE EXECUTE ON FUNCTION catalog.popularity_ensure_partitions(date, date) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION catalog.popularity_drop_partition(date, integer) FROM PUBLIC;
