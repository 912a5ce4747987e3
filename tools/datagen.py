"""The one data generator of the demo, ``make airflow``, the tests' bulk data and the benchmark:
domain tables and seeded, set-based data in PostgreSQL (never used by the jobs).

News: ``posts`` posts with uuid v7 ids over ~13 months before ``now`` (a share ``archived``
Archived); ``comments`` comments spread Pareto(1.5)-like over the posts (a third of the posts
have none, the hottest at most ~0.4 % of all comments), 85 % Visible / 10 % Hidden / 5 %
Deleted, a share ``recent`` of them changed in the 25 h before ``now`` (``updated_at``), stored
in arrival order; ``comments_count`` exact except on a share ``drift`` of the non-archived posts
(an offset of -3..+5, never 0).

Catalog: ``property_objects`` and ``projects`` cards (85 % Published, 10 % Hidden, 5 % Delisted),
``poison`` cards with a NULL and a negative counter, ``nights`` nights of snapshot history before
``as_of`` with the nights ``missed`` days before it absent (as after an outage), stored night by
night as the job writes it, and yesterday's scores as the starting state.

Every random value comes from ``random()`` after ``setseed`` in serial plans (parallel query off),
so the same arguments always give the same rows, ids included.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta

from tools.devenv import REPO, run_sql_file

SETTINGS = (
    "SET max_parallel_workers_per_gather = 0",
    "SET work_mem = '2GB'",
    "SET maintenance_work_mem = '2GB'",
    "SET synchronous_commit = off",
)

# uuid v7 of instant ts, its random bits from random(), so that seeded data repeats (the ids the
# jobs and the hot path write come from include/sql/common/uuid7_now.sql, gen_random_uuid())
UUID7_FN = """
CREATE FUNCTION pg_temp.uuid7(ts timestamptz) RETURNS uuid LANGUAGE sql VOLATILE AS $$
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0')
        || '7' || lpad(to_hex(floor(random() * 4096)::int), 3, '0')
        || to_hex(8 + floor(random() * 4)::int)
        || lpad(to_hex(floor(random() * 1152921504606846976::float8)::bigint), 15, '0'))::uuid
$$
"""

POSTS_GEN = """
CREATE TEMP TABLE posts_gen AS
WITH raw AS (
    SELECT i, ts AS created_at, pg_temp.uuid7(ts) AS id, random() < %(archived)s AS archived,
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

COMMENTS = """
INSERT INTO news.comments (id, post_id, status, created_at, updated_at)
SELECT pg_temp.uuid7(ct), post_id,
       CASE WHEN rs < 0.85 THEN 'Visible' WHEN rs < 0.95 THEN 'HiddenByModerator'
            ELSE 'DeletedByAuthor' END,
       x.ct,
       CASE WHEN rc < %(recent)s THEN %(now)s::timestamptz - ra * interval '25 hours'
            ELSE x.ct END
  FROM (SELECT p.id AS post_id, p.created_at + random() * interval '3 days' AS ct,
               random() AS rs, random() AS rc, random() AS ra
          FROM posts_gen p CROSS JOIN LATERAL generate_series(1, p.n) AS g) AS x
 ORDER BY x.ct
"""

POSTS = """
INSERT INTO news.posts (id, status, comments_count, updated_at)
SELECT g.id, CASE WHEN g.archived THEN 'Archived' ELSE 'Published' END,
       CASE WHEN NOT g.archived AND g.rd < %(drift)s
            THEN CASE WHEN coalesce(v.n, 0) + g.d < 0 THEN coalesce(v.n, 0) + 1
                      ELSE coalesce(v.n, 0) + g.d END
            ELSE coalesce(v.n, 0) END,
       g.created_at
  FROM (SELECT pg.*, random() AS rd,
               (ARRAY[-3, -2, -1, 1, 2, 5])[1 + floor(random() * 6)::int] AS d
          FROM posts_gen pg) AS g
  LEFT JOIN (SELECT post_id, count(*)::int AS n FROM news.comments
              WHERE status = 'Visible' GROUP BY post_id) AS v ON v.post_id = g.id
 ORDER BY g.i
"""

NEWS_FACTS = """
SELECT (SELECT count(*) FROM news.posts) AS posts,
       (SELECT count(*) FROM news.posts WHERE status = 'Archived') AS archived,
       (SELECT count(*) FROM news.comments) AS comments,
       (SELECT count(*) FROM news.comments WHERE status = 'Visible') AS visible_comments,
       (SELECT count(*) FROM posts_gen WHERE n = 0) AS posts_without_comments,
       (SELECT max(n) FROM posts_gen) AS max_comments_per_post,
       (SELECT count(*) FROM news.comments
         WHERE updated_at >= %(now)s::timestamptz - interval '26 hours')
           AS comments_changed_recently,
       (SELECT count(*) FROM news.posts p
          LEFT JOIN (SELECT post_id, count(*) AS n FROM news.comments
                      WHERE status = 'Visible' GROUP BY post_id) v ON v.post_id = p.id
         WHERE p.status IS DISTINCT FROM 'Archived'
           AND p.comments_count <> coalesce(v.n, 0)) AS drifted
"""

CARD_GEN = """
CREATE TEMP TABLE card_gen AS
SELECT kind, i, created_at, pg_temp.uuid7(created_at) AS id,
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

CARDS = """
INSERT INTO {table} (id, status, popularity_views, popularity_score, updated_at)
SELECT id, status,
       CASE WHEN %(poison)s AND kind = 'PropertyObject' AND i = 0 THEN NULL
            WHEN %(poison)s AND kind = 'PropertyObject' AND i = 1 THEN -1
            ELSE (b + floor(r * %(nights)s + r * ut))::bigint END,
       round((random() * 100)::numeric, 4), created_at
  FROM card_gen WHERE kind = %(kind)s ORDER BY i
"""

NIGHT = """
INSERT INTO catalog.popularity_daily_views
       (id, card_kind, card_id, run_date, cumulative_views, created_at)
SELECT md5(random()::text || ':' || kind || ':' || i || ':' || %(d)s)::uuid, kind, id,
       %(night)s::date, (b + floor(r * %(d)s + r * random()))::bigint,
       (%(night)s::date + time '03:05') AT TIME ZONE 'UTC' + i * interval '1 ms'
  FROM card_gen
"""

CATALOG_FACTS = """
SELECT (SELECT count(*) FROM catalog.property_object_cards)
     + (SELECT count(*) FROM catalog.project_cards) AS cards,
       (SELECT count(*) FROM catalog.property_object_cards) AS property_object_cards,
       (SELECT count(*) FROM catalog.project_cards) AS project_cards,
       (SELECT count(*) FROM catalog.property_object_cards WHERE status = 'Delisted')
     + (SELECT count(*) FROM catalog.project_cards WHERE status = 'Delisted') AS delisted,
       (SELECT count(*) FROM catalog.popularity_daily_views) AS snapshots,
       (SELECT count(DISTINCT run_date) FROM catalog.popularity_daily_views) AS nights
"""


def uuid7(ts: datetime, rnd: random.Random) -> uuid.UUID:
    """A version 7 uuid for instant ``ts`` (time-ordered), random bits from ``rnd``."""
    ms = int(ts.timestamp() * 1000) & ((1 << 48) - 1)
    value = (
        (ms << 80) | (0x7 << 76) | (rnd.getrandbits(12) << 64) | (0b10 << 62) | rnd.getrandbits(62)
    )
    return uuid.UUID(int=value)


def create_news_schema(dsn: str, indexes: bool = True) -> None:
    run_sql_file(dsn, "schema/news_domain.sql")
    if indexes:
        run_sql_file(dsn, "schema/news_recommended_indexes.sql")


def create_catalog_schema(dsn: str) -> None:
    run_sql_file(dsn, "schema/catalog_domain.sql")


def copy_rows(conn, table: str, columns: Iterable[str], rows: Iterable[tuple]) -> None:
    cols = ", ".join(columns)
    with conn.cursor() as cur, cur.copy(f"COPY {table} ({cols}) FROM STDIN") as cp:
        for row in rows:
            cp.write_row(row)


def _session(dsn: str, seed: float):
    import psycopg

    conn = psycopg.connect(dsn, autocommit=True)
    for s in SETTINGS:
        conn.execute(s)
    conn.execute(UUID7_FN)
    conn.execute("SELECT setseed(%s)", (seed,))
    return conn


def _facts(conn, sql: str, params: dict | None = None) -> dict:
    cur = conn.execute(sql, params or {})
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def news(
    dsn: str,
    posts: int,
    comments: int,
    *,
    seed: float = 0.13,
    now: datetime | None = None,
    drift: float = 0.01,
    recent: float = 0.01,
    archived: float = 0.05,
    schema: bool = True,
    log=None,
) -> dict:
    """Generate the news data into ``dsn`` (``schema``: create the domain tables first, and the
    recommended indexes after the load). ``seed`` in [-0.5, 0.5]. Returns what was made."""
    now = now or datetime.now(UTC)
    if schema:
        create_news_schema(dsn, indexes=False)
    p = {"now": now, "n": posts, "target": comments, "archived": archived}
    p |= {"recent": recent, "drift": drift, "w_max": max(10.0, 0.004 * comments / 5)}
    with _session(dsn, seed) as conn:
        for i, (what, sql) in enumerate((("posts (plan)", POSTS_GEN), ("comments", COMMENTS))):
            _step(conn, what, sql, p, log)
            conn.execute("SELECT setseed(%s)", (seed - 0.5 + 0.25 * i,))
        _step(conn, "posts", POSTS, p, log)
        if schema:
            t = time.monotonic()
            run_sql_file(_with_mem(dsn), "schema/news_recommended_indexes.sql")
            _say(log, "recommended indexes", time.monotonic() - t)
        conn.execute("ANALYZE news.posts, news.comments")
        return _facts(conn, NEWS_FACTS, p)


def catalog(
    dsn: str,
    property_objects: int,
    projects: int,
    as_of: date,
    *,
    seed: float = 0.13,
    nights: int = 31,
    missed: Iterable[int] = (9, 17, 18),
    poison: bool = True,
    schema: bool = True,
    log=None,
) -> dict:
    """Generate the catalog data (cards and ``nights`` nights of snapshots before ``as_of``)
    into ``dsn``; the snapshot table and its indexes are created here. Returns what was made."""
    if schema:
        create_catalog_schema(dsn)
    ddl = (REPO / "include" / "sql" / "schema" / "catalog_popularity.sql").read_text()
    missed = set(missed)
    with _session(dsn, seed) as conn:
        conn.execute(ddl)  # partitioned: each night's indexes are built as it is loaded
        first = as_of - timedelta(days=nights)
        while first < as_of:  # one partition a night, as the job creates them
            through = min(first + timedelta(days=62), as_of - timedelta(days=1))
            conn.execute("SELECT catalog.popularity_ensure_partitions(%s, %s)", (first, through))
            first = through + timedelta(days=1)
        _step(conn, "cards (plan)", CARD_GEN, {"n1": property_objects, "n2": projects}, log)
        for kind, table in (
            ("PropertyObject", "catalog.property_object_cards"),
            ("Project", "catalog.project_cards"),
        ):
            p = {"kind": kind, "poison": poison, "nights": nights}
            _step(conn, f"cards {kind}", CARDS.format(table=table), p, log)
        t = time.monotonic()
        for d in range(nights):
            if nights - d not in missed:
                night = as_of - timedelta(days=nights - d)
                conn.execute(NIGHT, {"d": d, "night": night})
        _say(log, f"snapshots ({nights - len(missed)} nights)", time.monotonic() - t)
        conn.execute("ANALYZE catalog.popularity_daily_views")
        facts = _facts(conn, CATALOG_FACTS)
    facts["poison"] = 2 if poison else 0
    return facts


def _with_mem(dsn: str) -> str:
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, options="-c maintenance_work_mem=2GB")


def _step(conn, what: str, sql: str, params: dict, log) -> None:
    t = time.monotonic()
    conn.execute(sql, params)
    _say(log, what, time.monotonic() - t)


def _say(log, what: str, seconds: float) -> None:
    if log is not None:
        log.info("  %-34s %7.1f s", what, seconds)
