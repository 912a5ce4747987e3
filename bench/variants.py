"""Scratch variants of the job code, measured without touching ``plugins/`` or ``include/sql``.

A variant may swap the text of SQL files (by monkeypatching ``pin_nightly.db.sql`` and its
imported copies in the job modules), change the batch size, psycopg's automatic server-side
prepare, or session settings of the worker connections. ``baseline`` is the code as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------
# SQL texts of the variants
# ---------------------------------------------------------------------------------------------

# news/apply.sql with the count driven by one range scan of the partial index over the batch's
# key interval instead of one index descent per post id (= ANY(array) in PostgreSQL 16 descends
# the index once per element). Same result: the interval [min(ids), max(ids)] of a batch holds
# only the batch's posts plus archived/ineligible ones, which the join to the ids drops.
NEWS_APPLY_RANGE = """
-- Batch statement 2 (bench variant news_apply_range): count by one index range scan.
WITH ids AS (
    SELECT unnest(%(ids)s::uuid[]) AS id
), bounds AS (  -- no min(uuid)/max(uuid) in PostgreSQL 16
    SELECT (SELECT id FROM ids ORDER BY id LIMIT 1) AS lo,
           (SELECT id FROM ids ORDER BY id DESC LIMIT 1) AS hi
), visible AS (
    SELECT c.post_id, count(*) AS n
      FROM news.comments c, bounds b
     WHERE c.post_id BETWEEN b.lo AND b.hi AND c.status = 'Visible'
     GROUP BY c.post_id
), drift AS (
    SELECT p.id, p.comments_count AS count_from, coalesce(v.n, 0)::integer AS count_to
      FROM news.posts p
      LEFT JOIN visible v ON v.post_id = p.id
     WHERE p.id = ANY(%(ids)s::uuid[])
       AND p.comments_count IS DISTINCT FROM coalesce(v.n, 0)
), corrected AS (
    UPDATE news.posts p
       SET comments_count = d.count_to, updated_at = clock_timestamp()
      FROM drift d
     WHERE p.id = d.id AND NOT %(dry_run)s
    RETURNING p.id
), recorded AS (
    INSERT INTO pin_nightly.news_drift (sweep_id, run_id, post_id, count_from, count_to, dry_run)
    SELECT %(sweep_id)s, %(run_id)s, d.id, d.count_from, d.count_to, %(dry_run)s
      FROM drift d
    RETURNING post_id
), unskipped AS (
    DELETE FROM pin_nightly.news_skipped_post
     WHERE post_id = ANY(%(ids)s::uuid[]) AND NOT %(dry_run)s
    RETURNING post_id
)
SELECT d.id::text AS id, d.count_from, d.count_to,
       (SELECT count(*) FROM corrected) AS n_corrected,
       (SELECT count(*) FROM recorded) AS n_recorded,
       (SELECT count(*) FROM unskipped) AS n_unskipped
  FROM drift d
 ORDER BY d.id
"""

# news/full_lock.sql taking the locks in the same index scan that finds the candidates (one
# pass over the primary key instead of a scan plus 500 probes). A locked row is not returned,
# so the skipped ones are the candidates of the first scan that the locking scan did not get:
# same output columns and meaning as the original.
NEWS_FULL_LOCK_ONEPASS = """
-- FullSweep batch, statement 1 (bench variant news_lock_onepass).
WITH cand AS (
    SELECT id
      FROM news.posts
     WHERE id > coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id > coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND p.id <= (SELECT id FROM cand ORDER BY id DESC LIMIT 1)
       AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
SELECT c.id::text AS id, TRUE AS eligible, l.id IS NOT NULL AS locked
  FROM cand c LEFT JOIN locked l ON l.id = c.id
 ORDER BY c.id
"""



def _original(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "include" / "sql" / f"{name}.sql").read_text()


def sargable(text: str) -> str:
    """``(p IS NULL OR id > p)`` -> ``id > coalesce(p, nil uuid)`` (and the upper bound alike).

    With the OR form a *generic* plan (what a server-side prepared statement switches to after
    five executions) cannot use the bound as an index condition: it scans the key from the
    start of the table (or of the sweep) in every batch and filters, so batch k reads k
    batches' worth of rows. The coalesce form is an index condition in every plan.
    """
    import re

    out = re.sub(r"\(%\(after_id\)s::uuid IS NULL OR ([\w.]+) > %\(after_id\)s::uuid\)",
                 r"\1 > coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)",
                 text)
    out = re.sub(r"\(%\(upper_id\)s::uuid IS NULL OR ([\w.]+) <= %\(upper_id\)s::uuid\)",
                 r"\1 <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)",
                 out)
    if out == text:  # the file has sargable bounds already
        return text
    return "-- (bench variant: sargable keyset bounds)\n" + out


def _at_commit(name: str, commit: str = "8c0be2b") -> str | None:
    """The text of include/sql/<name>.sql at ``commit`` (the code the benchmark started from)."""
    import subprocess
    from pathlib import Path

    try:
        return subprocess.run(["git", "show", f"{commit}:include/sql/{name}.sql"],
                              cwd=Path(__file__).resolve().parents[1], check=True,
                              capture_output=True, text=True).stdout
    except Exception:  # noqa: BLE001 - no git, or history rewritten
        return None


LOCK_FILES = ("news/full_lock", "news/candidate_lock", "catalog/lock")
SARGABLE = {name: sargable(_original(name)) for name in LOCK_FILES}
# The lock statements as of commit 8c0be2b (keyset bounds as `(:after IS NULL OR id > :after)`)
ORIGINAL_LOCKS = {name: t for name in LOCK_FILES if (t := _at_commit(name))}

NIL, MAX = "'00000000-0000-0000-0000-000000000000'::uuid", "'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid"

# The lock statements end with `cand LEFT JOIN eligible LEFT JOIN locked` over CTE scans. When
# the planner believes a CTE has one row (news_window_candidate right after the window's
# candidates were inserted: never analyzed, or analyzed before this sweep_id existed; any
# generic plan of a prepared statement), it joins them with nested loops: batch_size^2
# comparisons per join. These versions merge the CTEs with UNION ALL + GROUP BY instead:
# O(n log n) whatever the estimates. Same output columns and meaning; bounds sargable.
NEWS_CANDIDATE_LOCK_GROUPBY = f"""
-- DailyWindow / targeted batch, statement 1 (bench variant lock_groupby).
WITH cand AS (
    SELECT post_id AS id
      FROM pin_nightly.news_window_candidate
     WHERE sweep_id = %(sweep_id)s
       AND post_id > coalesce(%(after_id)s::uuid, {NIL})
       AND post_id <= coalesce(%(upper_id)s::uuid, {MAX})
     ORDER BY post_id
     LIMIT %(limit)s
), eligible AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM cand) AND p.status IS DISTINCT FROM 'Archived'
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM eligible) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
SELECT id::text AS id, bool_or(e) AS eligible, bool_or(l) AS locked
  FROM (SELECT id, FALSE AS e, FALSE AS l FROM cand
        UNION ALL SELECT id, TRUE, FALSE FROM eligible
        UNION ALL SELECT id, TRUE, TRUE FROM locked) AS x
 GROUP BY id
 ORDER BY id
"""

NEWS_FULL_LOCK_GROUPBY = f"""
-- FullSweep batch, statement 1 (bench variant lock_groupby: one-pass lock, no joins).
WITH cand AS (
    SELECT id
      FROM news.posts
     WHERE id > coalesce(%(after_id)s::uuid, {NIL})
       AND id <= coalesce(%(upper_id)s::uuid, {MAX})
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id > coalesce(%(after_id)s::uuid, {NIL})
       AND p.id <= (SELECT id FROM cand ORDER BY id DESC LIMIT 1)
       AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
SELECT id::text AS id, TRUE AS eligible, bool_or(l) AS locked
  FROM (SELECT id, FALSE AS l FROM cand
        UNION ALL SELECT id, TRUE FROM locked) AS x
 GROUP BY id
HAVING bool_or(NOT l)  -- a candidate (a row only the locking scan saw is not one)
 ORDER BY id
"""

CATALOG_LOCK_GROUPBY = f"""
-- Batch statement 1 (bench variant lock_groupby).
WITH cand AS (
    SELECT id
      FROM {{cards}}
     WHERE id > coalesce(%(after_id)s::uuid, {NIL})
       AND id <= coalesce(%(upper_id)s::uuid, {MAX})
       AND status IS DISTINCT FROM 'Delisted'
       AND (NOT %(targeted)s OR id = ANY(%(card_ids)s::uuid[]))
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT c.id, c.popularity_views
      FROM {{cards}} c
     WHERE c.id IN (SELECT id FROM cand) AND c.status IS DISTINCT FROM 'Delisted'
     ORDER BY c.id
       FOR UPDATE OF c SKIP LOCKED
)
SELECT id::text AS id, bool_or(l) AS locked, max(views) AS views
  FROM (SELECT id, FALSE AS l, NULL::bigint AS views FROM cand
        UNION ALL SELECT id, TRUE, popularity_views FROM locked) AS x
 GROUP BY id
 ORDER BY id
"""

# FullSweep batch statement 1 that locks only the posts whose counter looks wrong in the
# statement's snapshot (a read-only check of every post of the batch, by one range scan of the
# comments index), instead of locking every post. Statement 2 (news/apply, unchanged) recounts
# the locked ones in a newer snapshot, as before, so a correction is still made under the lock
# and counted after it. A post whose committed state is consistent needs no lock: the hot path
# changes a comment and the counter in one transaction, which a snapshot sees whole or not at
# all. Non-suspect posts come back as "not eligible": with this variant `processed` (and the
# summary's posts_reconciled) would count only the suspects; make_batch would have to count
# the candidates instead.
NEWS_FULL_LOCK_DRIFT_ONLY = f"""
-- FullSweep batch, statement 1 (bench variant lock_drift_only).
WITH cand AS (
    SELECT id, comments_count
      FROM news.posts
     WHERE id > coalesce(%(after_id)s::uuid, {NIL})
       AND id <= coalesce(%(upper_id)s::uuid, {MAX})
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), counted AS (
    SELECT c.post_id, count(*) AS n
      FROM news.comments c
     WHERE c.post_id >= (SELECT id FROM cand ORDER BY id LIMIT 1)
       AND c.post_id <= (SELECT id FROM cand ORDER BY id DESC LIMIT 1)
       AND c.status = 'Visible'
     GROUP BY c.post_id
), suspect AS (
    SELECT k.id
      FROM cand k LEFT JOIN counted v ON v.post_id = k.id
     WHERE k.comments_count IS DISTINCT FROM coalesce(v.n, 0)
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM suspect) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
SELECT id::text AS id, bool_or(s) AS eligible, bool_or(l) AS locked
  FROM (SELECT id, FALSE AS s, FALSE AS l FROM cand
        UNION ALL SELECT id, TRUE, FALSE FROM suspect
        UNION ALL SELECT id, TRUE, TRUE FROM locked) AS x
 GROUP BY id
 ORDER BY id
"""

LOCK_GROUPBY = {"news/full_lock": NEWS_FULL_LOCK_GROUPBY,
                "news/candidate_lock": NEWS_CANDIDATE_LOCK_GROUPBY,
                "catalog/lock": CATALOG_LOCK_GROUPBY}

# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    sql: dict[str, str] = field(default_factory=dict)
    # overrides that apply to a news FullSweep only (dense key ranges), not to DailyWindow
    sql_full_sweep: dict[str, str] = field(default_factory=dict)
    batch_size: dict[str, int] = field(default_factory=dict)  # job -> batch size
    prepare_threshold: Any = "default"  # psycopg: 5 by default; None = never prepare
    session: tuple[str, ...] = ()
    # DDL run on the benchmark database before / after the variant's runs (scratch schema
    # changes of a job-owned table)
    db_setup: tuple[str, ...] = ()
    db_teardown: tuple[str, ...] = ()


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("baseline", "the code as it is (news batch 500, catalog batch 1000)"),
    Variant("bs2000", "batch_size 2000 (news) / 4000 (catalog)",
            batch_size={"news": 2000, "catalog": 4000}),
    Variant("bs5000", "batch_size 5000 (news) / 10000 (catalog)",
            batch_size={"news": 5000, "catalog": 10000}),
    Variant("bs200", "batch_size 200 (news) / 250 (catalog)",
            batch_size={"news": 200, "catalog": 250}),
    Variant("noprepare", "psycopg prepare_threshold=None: every statement planned with its "
            "parameters (no server-side prepared statement, no generic plan)",
            prepare_threshold=None),
    Variant("news_apply_range", "news/apply.sql counts by one index range scan of the batch's "
            "key interval (FullSweep only)", sql_full_sweep={"news/apply": NEWS_APPLY_RANGE}),
    Variant("news_lock_onepass", "news/full_lock.sql locks in the same range scan that finds "
            "the batch (sargable bounds)", sql={"news/full_lock": NEWS_FULL_LOCK_ONEPASS}),
    Variant("custom_plans", "SET plan_cache_mode = force_custom_plan on the worker connection "
            "(statements stay server-side prepared, but are planned with their parameters)",
            session=("SET plan_cache_mode = force_custom_plan",)),
    Variant("sargable", "keyset bounds of the lock statements as `id > coalesce(:after, "
            "nil uuid)` instead of `(:after IS NULL OR id > :after)`", sql=dict(SARGABLE)),
    Variant("lock_groupby", "lock statements without joins of CTEs (UNION ALL + GROUP BY; "
            "news FullSweep locks in one pass), sargable bounds", sql=dict(LOCK_GROUPBY)),
    Variant("best", "lock_groupby + news_apply_range",
            sql=dict(LOCK_GROUPBY), sql_full_sweep={"news/apply": NEWS_APPLY_RANGE}),
    Variant("best_bs2000", "best, batch_size 2000 (news) / 2000 (catalog)",
            sql=dict(LOCK_GROUPBY), sql_full_sweep={"news/apply": NEWS_APPLY_RANGE},
            batch_size={"news": 2000, "catalog": 2000}),
    Variant("or_bounds", "the lock statements of commit 8c0be2b, keyset bounds as "
            "`(:after IS NULL OR id > :after)` (what the first benchmark runs measured)",
            sql=dict(ORIGINAL_LOCKS)),
    Variant("async_commit", "SET synchronous_commit = off on the worker connection (a crash "
            "loses at most the last few batches' corrections and cursor moves, which the next "
            "run redoes: the recount is idempotent)",
            session=("SET synchronous_commit = off",)),
    Variant("lock_drift_only", "FullSweep locks only the posts whose counter looks wrong in "
            "a read-only check of the batch (+ lock_groupby, news_apply_range)",
            sql={**LOCK_GROUPBY},
            sql_full_sweep={"news/full_lock": NEWS_FULL_LOCK_DRIFT_ONLY,
                            "news/apply": NEWS_APPLY_RANGE}),
    Variant("lock_drift_only_bs2000", "lock_drift_only + async_commit, batch_size 2000",
            sql={**LOCK_GROUPBY},
            sql_full_sweep={"news/full_lock": NEWS_FULL_LOCK_DRIFT_ONLY,
                            "news/apply": NEWS_APPLY_RANGE},
            batch_size={"news": 2000}, session=("SET synchronous_commit = off",)),
    Variant("best_async_bs2000", "best + async_commit, batch_size 2000",
            sql=dict(LOCK_GROUPBY), sql_full_sweep={"news/apply": NEWS_APPLY_RANGE},
            batch_size={"news": 2000, "catalog": 2000},
            session=("SET synchronous_commit = off",)),
    Variant("catalog_lean_indexes", "lock_groupby, and without the redundant "
            "ix_popularity_daily_window on popularity_daily_views (the unique index has the "
            "same columns)",
            sql={"catalog/lock": CATALOG_LOCK_GROUPBY},
            db_setup=("DROP INDEX catalog.ix_popularity_daily_window",),
            db_teardown=("CREATE INDEX ix_popularity_daily_window ON "
                         "catalog.popularity_daily_views (card_kind, card_id, run_date DESC)",
                         "VACUUM ANALYZE catalog.popularity_daily_views")),
    Variant("best_bs5000", "best, batch_size 5000 (news) / 5000 (catalog)",
            sql=dict(LOCK_GROUPBY), sql_full_sweep={"news/apply": NEWS_APPLY_RANGE},
            batch_size={"news": 5000, "catalog": 5000}),
)}


def get(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None


def batch_size(variant: Variant, job: str, default: int) -> int:
    return variant.batch_size.get(job, default)


_ORIGINAL = None


def install(variant: Variant, full_sweep: bool = True,
            labels: dict[str, str] | None = None) -> dict[str, str]:
    """Route ``sql(name)`` of every job module through the variant; return text -> name labels.

    The job modules bind ``sql`` with ``from pin_nightly.db import sql``; each binding is
    replaced. Idempotent; installing ``baseline`` restores the original texts.
    """
    global _ORIGINAL
    from pin_nightly import catalog, db, jobs, keyset, lease, news

    if _ORIGINAL is None:
        _ORIGINAL = db.sql
    original = _ORIGINAL
    labels = {} if labels is None else labels
    overrides = {**variant.sql, **(variant.sql_full_sweep if full_sweep else {})}

    @functools.lru_cache(maxsize=None)
    def patched(name: str) -> str:
        text = overrides.get(name) or original(name)
        labels[text] = name
        return text

    for mod in (db, keyset, lease, news, catalog, jobs):
        if hasattr(mod, "sql"):
            mod.sql = patched
    return labels
