"""The benchmark's data: made once per scale by the shared generator (``tools/datagen.py``)
into ``pin_bench_news_s<scale>`` / ``pin_bench_catalog_s<scale>``, reused by later runs, and put
back between measurements from pristine copies in schema ``bench`` (see bench/README.md).
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta

from bench.common import AS_OF, NEWS_ANCHOR, SEED, db_name

log = logging.getLogger("bench.data")
VERSION = 4  # rows identical to the generator of version 4: its data is reused
CATALOG_VERSION = 5  # the snapshot table partitioned by night (version 4: one table)
PIN_TABLES = (
    "pin_nightly.job_lease, pin_nightly.sweep, pin_nightly.sweep_range, pin_nightly.run_log, "
    "pin_nightly.news_drift, pin_nightly.news_window_candidate, pin_nightly.news_skipped_post, "
    "pin_nightly.sweep_control, pin_nightly.control_event"
)
PIN_VACUUM = "VACUUM ANALYZE pin_nightly.sweep, pin_nightly.sweep_range, pin_nightly.job_lease"
CARDS = (("PropertyObject", "catalog.property_object_cards"), ("Project", "catalog.project_cards"))


def _conn(dsn: str, **kw):
    import psycopg

    return psycopg.connect(dsn, autocommit=True, **kw)


def _meta(dsn: str) -> dict | None:
    try:
        with _conn(dsn) as c:
            if c.execute("SELECT to_regclass('bench.meta')").fetchone()[0] is None:
                return None
            return dict(c.execute("SELECT k, v FROM bench.meta").fetchall())
    except Exception:  # noqa: BLE001 - absent or half-made: regenerated
        return None


def _write_meta(c, meta: dict) -> None:
    from psycopg.types.json import Jsonb

    c.execute("CREATE TABLE IF NOT EXISTS bench.meta (k text PRIMARY KEY, v jsonb)")
    c.execute(
        "INSERT INTO bench.meta SELECT * FROM jsonb_each(%s) "
        "ON CONFLICT (k) DO UPDATE SET v = excluded.v",
        (Jsonb(meta, dumps=lambda o: json.dumps(o, default=str)),),
    )


def _ensure(name: str, scale: float, regenerate: bool, make, version: int = VERSION) -> dict:
    """The database ``name`` made by ``make(dsn) -> facts`` unless a complete one of this scale,
    seed and generator version exists; the job-owned schema is always recreated from today's
    DDL."""
    from tools import devenv

    dsn = devenv.dsn_for(name)
    with _conn(devenv.admin_dsn()) as c:
        exists = c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    meta = None if regenerate or not exists else _meta(dsn)
    if meta and meta.get("complete") and meta["scale"] == scale and meta["seed"] == SEED:
        if meta.get("version") == version:
            log.info("%s present (generated %s): reused", name, meta["generated_at"])
            with _conn(dsn) as c:
                c.execute("DROP SCHEMA IF EXISTS pin_nightly CASCADE")
            devenv.run_sql_file(dsn, "schema/pin_nightly.sql")
            return meta
    log.info("generating %s (scale %g)...", name, scale)
    t0 = time.monotonic()
    dsn = devenv.recreate_database(name)
    devenv.run_sql_file(dsn, "schema/pin_nightly.sql")
    facts = make(dsn)
    with _conn(dsn) as c:
        c.execute("CREATE SCHEMA IF NOT EXISTS bench")
        tables = [t for _, t in CARDS] + ["catalog.popularity_daily_views"]
        if "posts" in facts:
            c.execute(
                "CREATE TABLE bench.posts_pristine AS "
                "SELECT id, comments_count, updated_at FROM news.posts"
            )
            c.execute("ALTER TABLE bench.posts_pristine ADD PRIMARY KEY (id)")
            tables = ["news.posts", "news.comments"]
        else:
            c.execute(
                "CREATE TABLE bench.cards_pristine AS "
                + " UNION ALL ".join(
                    f"SELECT '{k}'::text AS kind, id, popularity_score, updated_at FROM {t}"
                    for k, t in CARDS
                )
            )
            c.execute("ALTER TABLE bench.cards_pristine ADD PRIMARY KEY (kind, id)")
        for t in tables:
            if t == "catalog.popularity_daily_views":  # set on its partitions, not the parent
                _autovacuum_off_partitions(c)
            else:
                c.execute(f"ALTER TABLE {t} SET (autovacuum_enabled = off)")
        c.execute("VACUUM ANALYZE")
        size = c.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
        meta = {
            "scale": scale,
            "seed": SEED,
            "version": version,
            "generated_at": datetime.now(UTC).isoformat(),
            "changes_anchor": NEWS_ANCHOR.isoformat(),
            "facts": facts,
            "db_size": size.fetchone()[0],
            "generate_s": round(time.monotonic() - t0, 1),
            "complete": True,
        }
        _write_meta(c, meta)
    log.info("%s ready in %.0f s: %s", name, meta["generate_s"], facts)
    return meta


def _autovacuum_off_partitions(c) -> None:
    for (name,) in c.execute(
        "SELECT partition_name FROM catalog.popularity_partitions()"
    ).fetchall():
        c.execute(f"ALTER TABLE {name} SET (autovacuum_enabled = off)")


def ensure_news(scale: float, regenerate: bool = False) -> dict:
    from tools import datagen

    n = max(1, round(1_000_000 * scale))

    def make(dsn):
        return datagen.news(dsn, n, 10 * n, seed=SEED % 1000 / 1000, now=NEWS_ANCHOR, log=log)

    return _ensure(db_name("news", scale), scale, regenerate, make)


def ensure_catalog(scale: float, regenerate: bool = False) -> dict:
    from tools import datagen

    n1, n2 = max(2, round(300_000 * scale)), max(1, round(5_000 * scale))

    def make(dsn):
        return datagen.catalog(dsn, n1, n2, AS_OF, seed=SEED % 1000 / 1000, log=log)

    return _ensure(db_name("catalog", scale), scale, regenerate, make, CATALOG_VERSION)


def reage_news(dsn: str, max_age: timedelta = timedelta(minutes=20)) -> None:
    """Move the recent comment changes (the DailyWindow's input) up to the wall clock, keeping
    their offsets, when they are older than ``max_age``: the window looks back from now."""
    with _conn(dsn) as c:
        anchor = datetime.fromisoformat(_meta(dsn)["changes_anchor"])
        now = datetime.now(UTC).replace(microsecond=0)
        if now - anchor < max_age:
            return
        c.execute(
            "UPDATE news.comments SET updated_at = updated_at + (%(now)s - %(anchor)s) "
            "WHERE updated_at >= %(anchor)s::timestamptz - interval '26 hours'",
            {"now": now, "anchor": anchor},
        )
        _write_meta(c, {"changes_anchor": now.isoformat()})
        c.execute("VACUUM ANALYZE news.comments")


def reset_news(dsn: str, hotpath_since: float | None = None) -> None:
    """Restore the posts' counters, empty the job-owned tables, CLUSTER + VACUUM the posts,
    CHECKPOINT; with
    ``hotpath_since`` (time.time()), first delete the comments the hot path created."""
    with _conn(dsn) as c:
        c.execute(f"TRUNCATE {PIN_TABLES}")
        if hotpath_since is not None:
            c.execute(
                "DELETE FROM news.comments WHERE updated_at >= to_timestamp(%s) "
                "AND created_at > %s",
                (hotpath_since - 60, NEWS_ANCHOR),
            )
            c.execute("VACUUM ANALYZE news.comments")
        c.execute("""
            UPDATE news.posts p SET comments_count = o.comments_count, updated_at = o.updated_at
              FROM bench.posts_pristine o
             WHERE o.id = p.id AND (p.comments_count, p.updated_at)
                   IS DISTINCT FROM (o.comments_count, o.updated_at)""")
        # the same physical order every time: otherwise repeated corrections and restores
        # gather the drifted posts on a few pages and later runs write fewer full-page images
        c.execute("CLUSTER news.posts USING posts_pkey")
        c.execute("VACUUM ANALYZE news.posts")
        c.execute(PIN_VACUUM)
        c.execute("CHECKPOINT")


def reset_catalog(dsn: str, views: bool = False) -> None:
    """Remove the snapshots of AS_OF, put back the night retention deleted (once, before
    anything else is measured) and yesterday's scores (``views``: and the counters the view
    consumer incremented), empty the job-owned tables, VACUUM, CHECKPOINT."""
    with _conn(dsn) as c:
        c.execute(f"TRUNCATE {PIN_TABLES}")
        # tonight's partition and the week after it empty, as the night before creates them
        c.execute(f"""
            DO $drop$
            DECLARE p record;
            BEGIN
                FOR p IN SELECT partition_name FROM catalog.popularity_partitions()
                          WHERE lower_bound >= '{AS_OF}' LOOP
                    EXECUTE 'DROP TABLE ' || p.partition_name;
                END LOOP;
            END
            $drop$""")
        ahead = (AS_OF, AS_OF + timedelta(days=7))
        c.execute("SELECT catalog.popularity_ensure_partitions(%s, %s)", ahead)
        oldest = AS_OF - timedelta(days=31)
        c.execute("SELECT catalog.popularity_ensure_partitions(%s, %s)", (oldest, oldest))
        _autovacuum_off_partitions(c)
        c.execute(
            "CREATE TABLE IF NOT EXISTS bench.oldest_night AS "
            "SELECT * FROM catalog.popularity_daily_views WHERE run_date = %s",
            (oldest,),
        )
        c.execute(
            "INSERT INTO catalog.popularity_daily_views SELECT * FROM bench.oldest_night "
            "WHERE NOT EXISTS (SELECT FROM catalog.popularity_daily_views WHERE run_date = %s) "
            "ORDER BY card_kind, card_id",
            (oldest,),
        )
        c.execute(
            "CREATE TABLE IF NOT EXISTS bench.views_pristine AS "
            "SELECT id, popularity_views FROM catalog.property_object_cards"
        )
        if views:
            restore_views(dsn)
        for kind, table in CARDS:
            c.execute(
                f"""
                UPDATE {table} c SET popularity_score = o.popularity_score,
                       updated_at = o.updated_at
                  FROM bench.cards_pristine o
                 WHERE o.kind = %s AND o.id = c.id
                   AND (c.popularity_score, c.updated_at)
                       IS DISTINCT FROM (o.popularity_score, o.updated_at)""",
                (kind,),
            )
        c.execute("VACUUM catalog.popularity_daily_views, " + ", ".join(t for _, t in CARDS))
        c.execute(PIN_VACUUM)
        c.execute("CHECKPOINT")


def restore_views(dsn: str) -> None:
    """Put back the view counters the hot path's view consumer incremented."""
    with _conn(dsn) as c:
        c.execute("""
            UPDATE catalog.property_object_cards c SET popularity_views = o.popularity_views
              FROM bench.views_pristine o
             WHERE o.id = c.id AND c.popularity_views IS DISTINCT FROM o.popularity_views""")


def news_checksum(dsn: str, full: bool = False) -> dict:
    """What the news job writes, summarized (``full``: and the drift left, a whole recount)."""
    drift = """, (SELECT count(*) FROM news.posts p LEFT JOIN (SELECT post_id, count(*) AS n
                  FROM news.comments WHERE status = 'Visible' GROUP BY post_id) v
                  ON v.post_id = p.id WHERE p.status IS DISTINCT FROM 'Archived'
                  AND p.comments_count <> coalesce(v.n, 0))"""
    with _conn(dsn) as c:
        row = c.execute(
            "SELECT sum(comments_count)::bigint, "
            "sum(hashtextextended(id::text || ':' || comments_count, 0)) % 1000000007"
            + (drift if full else ", 0")
            + " FROM news.posts"
        ).fetchone()
    return {"sum": int(row[0]), "hash": int(row[1]), "drift_left": int(row[2])}


def catalog_checksum(dsn: str) -> dict:
    """What the popularity job writes, summarized: scores and the night's snapshots."""
    from psycopg.rows import dict_row

    with _conn(dsn, row_factory=dict_row) as c:
        return c.execute(
            """
            SELECT (SELECT sum(popularity_score) FROM catalog.property_object_cards)::text
                       AS po_score_sum,
                   (SELECT sum(popularity_score) FROM catalog.project_cards)::text
                       AS project_score_sum,
                   (SELECT sum(hashtextextended(id::text || ':' || popularity_score, 0))
                           %% 1000000007 FROM catalog.property_object_cards)::bigint AS po_hash,
                   count(*) AS snapshots, coalesce(sum(cumulative_views), 0)::bigint AS views
              FROM catalog.popularity_daily_views WHERE run_date = %s""",
            (AS_OF,),
        ).fetchone()
