"""Seeded, reproducible benchmark data, generated set-based in PostgreSQL.

News (``pin_bench_news_s<scale>``): 1,000,000 x scale posts with uuid v7 ids over ~13 months
(5 % Archived); 10,000,000 x scale comments spread Pareto(1.5)-like over the posts (a third of the
posts have none, the hottest have tens of thousands), 85 % Visible / 10 % Hidden / 5 % Deleted,
1 % of them changed in the 25 h before the data's instant ``NEWS_ANCHOR`` (``updated_at``;
moved up to the wall clock before a run by :func:`reage_news`), stored in arrival order;
``comments_count`` exact except on 1 % of the non-archived posts (drift of -3..+5).

Catalog (``pin_bench_catalog_s<scale>``): 300,000 x scale property-object cards and 5,000 x scale
project cards (85 % Published, 10 % Hidden, 5 % Delisted), two poison counters (NULL and -1);
31 nights of snapshot history before ``AS_OF`` with three nights missing (as after an outage),
stored night by night as the job writes it; yesterday's scores as the starting state.

Every random value comes from ``random()`` after ``setseed`` in serial plans (parallel query
off), so a scale and seed always give the same rows. A pristine copy of what the jobs write
(posts' counters, cards' scores) is kept in schema ``bench``; :func:`reset_news` /
:func:`reset_catalog` restore it cheaply between repetitions.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from bench.common import AS_OF, GENERATOR_VERSION, NEWS_ANCHOR, SEED, catalog_db, news_db

log = logging.getLogger("bench.generate")

GEN_SETTINGS = (
    "SET max_parallel_workers_per_gather = 0",
    "SET work_mem = '2GB'",
    "SET maintenance_work_mem = '2GB'",
    "SET synchronous_commit = off",
)

UUID7_FN = """
CREATE OR REPLACE FUNCTION bench.uuid7(ts timestamptz) RETURNS uuid
LANGUAGE sql VOLATILE AS $$
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0')
        || '7' || lpad(to_hex(floor(random() * 4096)::int), 3, '0')
        || to_hex(8 + floor(random() * 4)::int)
        || lpad(to_hex(floor(random() * 1152921504606846976::float8)::bigint), 15, '0'))::uuid
$$
"""

NEWS_POSTS_GEN = """
CREATE TABLE bench.posts_gen AS
WITH raw AS (
    SELECT i, ts AS created_at, bench.uuid7(ts) AS id, random() < 0.05 AS archived,
           CASE WHEN random() < 1.0 / 3 THEN 0::float8
                ELSE least(power(greatest(random(), 1e-12), -1 / 1.5), %(w_max)s) END AS w
      FROM (SELECT i, %(now)s::timestamptz - interval '400 days'
                      + (i::float8 / %(n)s) * interval '395 days' AS ts
              FROM generate_series(0, %(n)s - 1) AS i) AS s
), k AS (
    SELECT (%(target)s + 0.5 * count(*) FILTER (WHERE w > 0)) / sum(w) AS c FROM raw
)
SELECT raw.i, raw.created_at, raw.id, raw.archived, floor(k.c * raw.w)::int AS n
  FROM raw CROSS JOIN k
 ORDER BY raw.i
"""

NEWS_COMMENTS = """
INSERT INTO news.comments (id, post_id, status, created_at, updated_at)
SELECT bench.uuid7(ct), post_id,
       CASE WHEN rs < 0.85 THEN 'Visible' WHEN rs < 0.95 THEN 'HiddenByModerator'
            ELSE 'DeletedByAuthor' END,
       x.ct,
       CASE WHEN rc < 0.01 THEN %(now)s::timestamptz - ra * interval '25 hours' ELSE x.ct END
  FROM (SELECT p.id AS post_id, p.created_at + random() * interval '3 days' AS ct,
               random() AS rs, random() AS rc, random() AS ra
          FROM bench.posts_gen p CROSS JOIN LATERAL generate_series(1, p.n) AS g) AS x
 ORDER BY x.ct
"""

NEWS_POSTS = """
INSERT INTO news.posts (id, status, comments_count, updated_at)
SELECT g.id, CASE WHEN g.archived THEN 'Archived' ELSE 'Published' END,
       CASE WHEN NOT g.archived AND g.rd < 0.01
            THEN CASE WHEN coalesce(v.n, 0) + g.d < 0 THEN coalesce(v.n, 0) + 1
                      ELSE coalesce(v.n, 0) + g.d END
            ELSE coalesce(v.n, 0) END,
       g.created_at
  FROM (SELECT pg.*, random() AS rd,
               (ARRAY[-3, -2, -1, 1, 2, 5])[1 + floor(random() * 6)::int] AS d
          FROM bench.posts_gen pg) AS g
  LEFT JOIN (SELECT post_id, count(*)::int AS n FROM news.comments
              WHERE status = 'Visible' GROUP BY post_id) AS v ON v.post_id = g.id
 ORDER BY g.i
"""

NEWS_FACTS = """
SELECT (SELECT count(*) FROM news.posts) AS posts,
       (SELECT count(*) FROM news.posts WHERE status = 'Archived') AS archived,
       (SELECT count(*) FROM news.comments) AS comments,
       (SELECT count(*) FROM news.comments WHERE status = 'Visible') AS visible_comments,
       (SELECT count(*) FROM bench.posts_gen WHERE n = 0) AS posts_without_comments,
       (SELECT max(n) FROM bench.posts_gen) AS max_comments_per_post,
       (SELECT count(*) FROM bench.posts_gen WHERE n >= 1000) AS posts_with_1000_plus,
       (SELECT count(*) FROM news.comments
         WHERE updated_at >= %(now)s::timestamptz - interval '26 hours') AS comments_changed_26h,
       (SELECT count(DISTINCT post_id) FROM news.comments
         WHERE updated_at >= %(now)s::timestamptz - interval '26 hours') AS posts_with_changes_26h,
       (SELECT count(*) FROM news.posts p
          LEFT JOIN (SELECT post_id, count(*) AS n FROM news.comments
                      WHERE status = 'Visible' GROUP BY post_id) v ON v.post_id = p.id
         WHERE p.status IS DISTINCT FROM 'Archived'
           AND p.comments_count <> coalesce(v.n, 0)) AS drifted
"""

CATALOG_CARD_GEN = """
CREATE TABLE bench.card_gen AS
SELECT kind, i, created_at, bench.uuid7(created_at) AS id,
       CASE WHEN rs < 0.85 THEN 'Published' WHEN rs < 0.95 THEN 'Hidden' ELSE 'Delisted' END
           AS status,
       b, r, ut
  FROM (SELECT 'PropertyObject'::text AS kind, i,
               timestamptz '2024-01-01 00:00+00' + (i::float8 / %(n1)s) * interval '600 days'
                   AS created_at,
               random() AS rs, floor(random() * 2000) AS b,
               3 * power(greatest(random(), 1e-12), -1 / 1.5) AS r, random() AS ut
          FROM generate_series(0, %(n1)s - 1) AS i
        UNION ALL
        SELECT 'Project', i,
               timestamptz '2024-01-01 00:00+00' + (i::float8 / %(n2)s) * interval '600 days',
               random(), floor(random() * 2000),
               20 * power(greatest(random(), 1e-12), -1 / 1.5), random()
          FROM generate_series(0, %(n2)s - 1) AS i) AS s
"""

CATALOG_CARDS = """
INSERT INTO {table} (id, status, popularity_views, popularity_score, updated_at)
SELECT id, status,
       CASE WHEN kind = 'PropertyObject' AND i = 0 THEN NULL
            WHEN kind = 'PropertyObject' AND i = 1 THEN -1
            ELSE (b + floor(r * 31 + r * ut))::bigint END,
       round((random() * 100)::numeric, 4), created_at
  FROM bench.card_gen WHERE kind = %(kind)s ORDER BY i
"""

CATALOG_NIGHT = """
INSERT INTO catalog.popularity_daily_views
       (id, card_kind, card_id, run_date, cumulative_views, created_at)
SELECT md5(random()::text || ':' || kind || ':' || i || ':' || %(d)s)::uuid, kind, id,
       %(night)s::date, (b + floor(r * %(d)s + r * random()))::bigint,
       (%(night)s::date + time '03:05') AT TIME ZONE 'UTC' + i * interval '1 ms'
  FROM bench.card_gen
"""

CATALOG_FACTS = """
SELECT (SELECT count(*) FROM catalog.property_object_cards) AS property_object_cards,
       (SELECT count(*) FROM catalog.project_cards) AS project_cards,
       (SELECT count(*) FROM catalog.property_object_cards WHERE status = 'Published')
           + (SELECT count(*) FROM catalog.project_cards WHERE status = 'Published') AS published,
       (SELECT count(*) FROM catalog.property_object_cards WHERE status = 'Delisted')
           + (SELECT count(*) FROM catalog.project_cards WHERE status = 'Delisted') AS delisted,
       (SELECT count(*) FROM catalog.popularity_daily_views) AS snapshots,
       (SELECT count(DISTINCT run_date) FROM catalog.popularity_daily_views) AS nights,
       (SELECT min(run_date) FROM catalog.popularity_daily_views) AS first_night,
       (SELECT max(run_date) FROM catalog.popularity_daily_views) AS last_night
"""

PIN_TABLES = (
    "pin_nightly.job_lease, pin_nightly.sweep, pin_nightly.sweep_range, "
    "pin_nightly.run_log, pin_nightly.news_drift, pin_nightly.news_window_candidate, "
    "pin_nightly.news_skipped_post"
)


def _connect(dsn: str, autocommit: bool = True):
    import psycopg

    return psycopg.connect(dsn, autocommit=autocommit)


def _dsn_with(dsn: str, **settings: str) -> str:
    from psycopg.conninfo import make_conninfo

    opts = " ".join(f"-c {k}={v}" for k, v in settings.items())
    return make_conninfo(dsn, options=opts)


def _database_exists(name: str) -> bool:
    from tools import devenv

    with _connect(devenv.admin_dsn()) as conn:
        return (
            conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            is not None
        )


def read_meta(dsn: str) -> dict | None:
    try:
        with _connect(dsn) as conn:
            if conn.execute("SELECT to_regclass('bench.meta')").fetchone()[0] is None:
                return None
            return {k: v for k, v in conn.execute("SELECT k, v FROM bench.meta").fetchall()}
    except Exception:  # noqa: BLE001 - a half-made database is regenerated
        return None


def _write_meta(conn, meta: dict) -> None:
    import json

    from psycopg.types.json import Jsonb

    meta = json.loads(json.dumps(meta, default=str))
    conn.execute("CREATE TABLE IF NOT EXISTS bench.meta (k text PRIMARY KEY, v jsonb)")
    for k, v in meta.items():
        conn.execute(
            "INSERT INTO bench.meta VALUES (%s, %s) ON CONFLICT (k) DO UPDATE SET v = excluded.v",
            (k, Jsonb(v)),
        )


def _usable(name: str, scale: float) -> dict | None:
    from tools import devenv

    if not _database_exists(name):
        return None
    meta = read_meta(devenv.dsn_for(name))
    if (
        meta
        and meta.get("complete")
        and meta.get("scale") == scale
        and meta.get("seed") == SEED
        and meta.get("version") == GENERATOR_VERSION
    ):
        return meta
    return None


def _step(conn, what: str, sql: str, params: dict | None = None) -> float:
    t = time.monotonic()
    cur = conn.execute(sql, params or {})
    dt = time.monotonic() - t
    log.info("  %-34s %7.1f s  %s", what, dt, "" if cur.rowcount < 0 else f"{cur.rowcount} rows")
    return dt


def refresh_job_tables(name: str) -> None:
    """Recreate the job-owned schema ``pin_nightly`` from the current DDL (it holds no data
    between benchmark runs), so that reused data is measured with today's tables."""
    from tools import devenv

    dsn = devenv.dsn_for(name)
    with _connect(dsn) as conn:
        conn.execute("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
    devenv.run_sql_file(dsn, "schema/pin_nightly.sql")


def ensure_news(scale: float, regenerate: bool = False) -> dict:
    """The news database of this scale, generated when absent or stale; returns its meta."""
    from tools import devenv
    from tools.demodata import create_news_schema

    name = news_db(scale)
    meta = None if regenerate else _usable(name, scale)
    if meta:
        log.info("news data %s present (generated %s): reused", name, meta["generated_at"])
        refresh_job_tables(name)
        return meta
    started = time.monotonic()
    log.info("generating news data %s (scale %g)...", name, scale)
    dsn = devenv.recreate_database(name)
    create_news_schema(dsn, indexes=False)
    devenv.run_sql_file(dsn, "schema/pin_nightly.sql")
    now = NEWS_ANCHOR  # "now" of the data; reage_news moves the recent changes to the clock
    n_posts = max(1, round(1_000_000 * scale))
    n_comments = max(1, round(10_000_000 * scale))
    with _connect(dsn) as conn:
        for s in GEN_SETTINGS:
            conn.execute(s)
        conn.execute("CREATE SCHEMA bench")
        conn.execute(UUID7_FN)
        conn.execute("SELECT setseed(%s)", (SEED % 1000 / 1000,))
        _step(
            conn,
            "posts (plan)",
            NEWS_POSTS_GEN,
            {
                "now": now,
                "n": n_posts,
                "target": n_comments,
                # the hottest post gets at most ~0.4 % of all comments, at every scale
                "w_max": max(10.0, 0.004 * n_comments / 5),
            },
        )
        conn.execute("SELECT setseed(%s)", (SEED % 1000 / 1000 - 0.5,))
        _step(conn, "comments", NEWS_COMMENTS, {"now": now})
        conn.execute("SELECT setseed(%s)", (SEED % 1000 / 1000 - 0.25,))
        _step(conn, "posts", NEWS_POSTS)
    t = time.monotonic()
    devenv.run_sql_file(
        _dsn_with(dsn, maintenance_work_mem="2GB"), "schema/news_recommended_indexes.sql"
    )
    log.info("  %-34s %7.1f s", "recommended indexes", time.monotonic() - t)
    with _connect(dsn) as conn:
        _step(
            conn,
            "pristine copy",
            "CREATE TABLE bench.posts_pristine AS "
            "SELECT id, comments_count, updated_at FROM news.posts",
        )
        conn.execute("ALTER TABLE bench.posts_pristine ADD PRIMARY KEY (id)")
        # Repeatable timings: vacuum runs between repetitions, not in the middle of one.
        for table in ("news.posts", "news.comments"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        _step(conn, "vacuum analyze", "VACUUM ANALYZE")
        row = conn.execute(NEWS_FACTS, {"now": now})
        facts = dict(zip([d.name for d in row.description], row.fetchone()))
        conn.execute("DROP TABLE bench.posts_gen")
        size = conn.execute(
            "SELECT pg_size_pretty(pg_database_size(current_database()))"
        ).fetchone()[0]
        meta = {
            "scale": scale,
            "seed": SEED,
            "version": GENERATOR_VERSION,
            "generated_at": datetime.now(UTC).isoformat(),
            "data_as_of": now.isoformat(),
            "changes_anchor": now.isoformat(),
            "facts": facts,
            "db_size": size,
            "generate_s": round(time.monotonic() - started, 1),
            "complete": True,
        }
        _write_meta(conn, meta)
    log.info("news data ready in %.0f s: %s (%s)", meta["generate_s"], facts, size)
    return meta


def ensure_catalog(scale: float, regenerate: bool = False) -> dict:
    """The catalog database of this scale, generated when absent or stale; returns its meta."""
    from tools import devenv
    from tools.demodata import create_catalog_schema
    from tools.devenv import REPO

    name = catalog_db(scale)
    meta = None if regenerate else _usable(name, scale)
    if meta:
        log.info("catalog data %s present (generated %s): reused", name, meta["generated_at"])
        refresh_job_tables(name)
        return meta
    started = time.monotonic()
    log.info("generating catalog data %s (scale %g)...", name, scale)
    dsn = devenv.recreate_database(name)
    create_catalog_schema(dsn)
    devenv.run_sql_file(dsn, "schema/pin_nightly.sql")
    ddl = (REPO / "include" / "sql" / "schema" / "catalog_popularity.sql").read_text()
    table_only = ddl.split("CREATE UNIQUE INDEX")[0]  # indexes after the load (faster)
    n1 = max(2, round(300_000 * scale))
    n2 = max(1, round(5_000 * scale))
    missing = {9, 17, 18}
    with _connect(dsn) as conn:
        for s in GEN_SETTINGS:
            conn.execute(s)
        conn.execute(table_only)
        conn.execute("CREATE SCHEMA bench")
        conn.execute(UUID7_FN)
        conn.execute("SELECT setseed(%s)", (SEED % 1000 / 1000,))
        _step(conn, "cards (plan)", CATALOG_CARD_GEN, {"n1": n1, "n2": n2})
        for kind, table in (
            ("PropertyObject", "catalog.property_object_cards"),
            ("Project", "catalog.project_cards"),
        ):
            _step(conn, f"cards {kind}", CATALOG_CARDS.format(table=table), {"kind": kind})
        t = time.monotonic()
        nights = 0
        for d in range(31):
            age = 31 - d
            if age in missing:
                continue
            conn.execute(CATALOG_NIGHT, {"d": d, "night": AS_OF - timedelta(days=age)})
            nights += 1
        log.info("  %-34s %7.1f s", f"snapshots ({nights} nights)", time.monotonic() - t)
    t = time.monotonic()
    devenv.run_sql_file(_dsn_with(dsn, maintenance_work_mem="2GB"), "schema/catalog_popularity.sql")
    log.info("  %-34s %7.1f s", "snapshot indexes", time.monotonic() - t)
    with _connect(dsn) as conn:
        _step(
            conn,
            "pristine copy",
            """
            CREATE TABLE bench.cards_pristine AS
            SELECT 'PropertyObject'::text AS kind, id, popularity_score, updated_at
              FROM catalog.property_object_cards
            UNION ALL
            SELECT 'Project', id, popularity_score, updated_at FROM catalog.project_cards""",
        )
        conn.execute("ALTER TABLE bench.cards_pristine ADD PRIMARY KEY (kind, id)")
        for table in (
            "catalog.property_object_cards",
            "catalog.project_cards",
            "catalog.popularity_daily_views",
        ):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
        _step(conn, "vacuum analyze", "VACUUM ANALYZE")
        row = conn.execute(CATALOG_FACTS)
        facts = dict(zip([d.name for d in row.description], row.fetchone()))
        conn.execute("DROP TABLE bench.card_gen")
        size = conn.execute(
            "SELECT pg_size_pretty(pg_database_size(current_database()))"
        ).fetchone()[0]
        meta = {
            "scale": scale,
            "seed": SEED,
            "version": GENERATOR_VERSION,
            "generated_at": datetime.now(UTC).isoformat(),
            "as_of": AS_OF.isoformat(),
            "facts": facts,
            "db_size": size,
            "generate_s": round(time.monotonic() - started, 1),
            "complete": True,
        }
        _write_meta(conn, meta)
    log.info("catalog data ready in %.0f s: %s (%s)", meta["generate_s"], facts, size)
    return meta


def reage_news(dsn: str, max_age: timedelta = timedelta(minutes=20)) -> bool:
    """Move the recent comment changes (the DailyWindow's input) up to now.

    The window looks back from the wall clock; data generated hours ago would fall out of it.
    The changes keep their offsets from the generation instant. Returns True when moved.
    """
    with _connect(dsn) as conn:
        meta = {k: v for k, v in conn.execute("SELECT k, v FROM bench.meta").fetchall()}
        anchor = datetime.fromisoformat(meta["changes_anchor"])
        now = datetime.now(UTC).replace(microsecond=0)
        if now - anchor < max_age:
            return False
        t = time.monotonic()
        n = conn.execute(
            "UPDATE news.comments SET updated_at = updated_at + (%(now)s - %(anchor)s) "
            "WHERE updated_at >= %(anchor)s::timestamptz - interval '26 hours'",
            {"now": now, "anchor": anchor},
        ).rowcount
        _write_meta(conn, {"changes_anchor": now.isoformat()})
        conn.execute("VACUUM ANALYZE news.comments")
        log.info(
            "moved %d recent comment changes forward by %s (%.1f s)",
            n,
            now - anchor,
            time.monotonic() - t,
        )
    return True


def reset_news(dsn: str) -> float:
    """Restore the posts' counters and empty the job-owned tables, then VACUUM."""
    t = time.monotonic()
    with _connect(dsn) as conn:
        conn.execute(f"TRUNCATE {PIN_TABLES}")
        conn.execute("""
            UPDATE news.posts p SET comments_count = o.comments_count, updated_at = o.updated_at
              FROM bench.posts_pristine o
             WHERE o.id = p.id AND (p.comments_count, p.updated_at)
                   IS DISTINCT FROM (o.comments_count, o.updated_at)""")
        conn.execute("VACUUM news.posts")
        conn.execute(
            "VACUUM ANALYZE pin_nightly.sweep, pin_nightly.sweep_range, pin_nightly.job_lease"
        )
        conn.execute("CHECKPOINT")
    return time.monotonic() - t


def reset_catalog(dsn: str) -> float:
    """Remove the as_of snapshots, restore yesterday's scores, empty job-owned tables, VACUUM."""
    t = time.monotonic()
    with _connect(dsn) as conn:
        conn.execute(f"TRUNCATE {PIN_TABLES}")
        conn.execute("DELETE FROM catalog.popularity_daily_views WHERE run_date >= %s", (AS_OF,))
        for kind, table in (
            ("PropertyObject", "catalog.property_object_cards"),
            ("Project", "catalog.project_cards"),
        ):
            conn.execute(
                f"""
                UPDATE {table} c SET popularity_score = o.popularity_score,
                       updated_at = o.updated_at
                  FROM bench.cards_pristine o
                 WHERE o.kind = %s AND o.id = c.id
                   AND (c.popularity_score, c.updated_at)
                       IS DISTINCT FROM (o.popularity_score, o.updated_at)""",
                (kind,),
            )
        conn.execute(
            "VACUUM catalog.popularity_daily_views, catalog.property_object_cards, "
            "catalog.project_cards"
        )
        conn.execute(
            "VACUUM ANALYZE pin_nightly.sweep, pin_nightly.sweep_range, pin_nightly.job_lease"
        )
        conn.execute("CHECKPOINT")
    return time.monotonic() - t


def news_checksum(dsn: str) -> dict:
    """What the news job writes, summarized: equal after the floor and after the job."""
    with _connect(dsn) as conn:
        row = conn.execute("""
            SELECT sum(p.comments_count)::bigint,
                   sum(hashtextextended(p.id::text || ':' || p.comments_count, 0)) % 1000000007,
                   count(*) FILTER (WHERE p.status IS DISTINCT FROM 'Archived'
                                    AND p.comments_count <> coalesce(v.n, 0))
              FROM news.posts p
              LEFT JOIN (SELECT post_id, count(*) AS n FROM news.comments
                          WHERE status = 'Visible' GROUP BY post_id) v ON v.post_id = p.id
        """).fetchone()
    return {"sum": int(row[0]), "hash": int(row[1]), "drift_left": int(row[2])}


def news_light_checksum(dsn: str) -> dict:
    with _connect(dsn) as conn:
        row = conn.execute("""
            SELECT sum(comments_count)::bigint,
                   sum(hashtextextended(id::text || ':' || comments_count, 0)) % 1000000007
              FROM news.posts""").fetchone()
    return {"sum": int(row[0]), "hash": int(row[1])}


def catalog_checksum(dsn: str) -> dict:
    with _connect(dsn) as conn:
        row = conn.execute(
            """
            SELECT (SELECT sum(popularity_score) FROM catalog.property_object_cards),
                   (SELECT sum(popularity_score) FROM catalog.project_cards),
                   (SELECT sum(hashtextextended(id::text || ':' || popularity_score, 0))
                           %% 1000000007 FROM catalog.property_object_cards),
                   (SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s),
                   (SELECT sum(cumulative_views) FROM catalog.popularity_daily_views
                     WHERE run_date = %s)
        """,
            (AS_OF, AS_OF),
        ).fetchone()
    return {
        "po_score_sum": str(row[0]),
        "project_score_sum": str(row[1]),
        "po_hash": int(row[2]),
        "snapshots_as_of": int(row[3]),
        "views_as_of": int(row[4] or 0),
    }
