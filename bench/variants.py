"""Scratch variants of the job code, measured without touching ``plugins/`` or ``include/sql``.

A variant may swap the text of SQL files (by monkeypatching ``pin_nightly.db.sql`` and its
imported copies in the job modules), change the batch size, psycopg's automatic server-side
prepare, or session settings of the worker connections. ``baseline`` is the code as it is.
Variants that measured earlier designs of the statements are in the git history of this file;
their results are summarized in ``bench/findings.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------
# SQL texts of the variants
# ---------------------------------------------------------------------------------------------

# The FullSweep statement 1 of the earlier design: lock every post of the batch FOR UPDATE SKIP
# LOCKED (no read-only check first); news/apply then recounts all of them. Same output columns
# as include/sql/news/full_lock.sql (every locked post is handed to news/apply).
NEWS_FULL_LOCK_ALL = """
-- FullSweep batch, statement 1 (bench variant lock_all: every post of the batch locked).
WITH cand AS (
    SELECT id
      FROM news.posts
     WHERE id >= coalesce(%(after_id)s::uuid, '00000000-0000-0000-0000-000000000000'::uuid)
       AND (%(after_id)s::uuid IS NULL OR id <> %(after_id)s::uuid)
       AND id <= coalesce(%(upper_id)s::uuid, 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid)
       AND status IS DISTINCT FROM 'Archived'
     ORDER BY id
     LIMIT %(limit)s
), locked AS (
    SELECT p.id
      FROM news.posts p
     WHERE p.id IN (SELECT id FROM cand) AND p.status IS DISTINCT FROM 'Archived'
     ORDER BY p.id
       FOR UPDATE OF p SKIP LOCKED
)
SELECT (SELECT count(*) FROM cand)                         AS n_read,
       (SELECT count(*) FROM cand)                         AS n_eligible,
       (SELECT id::text FROM cand ORDER BY id DESC LIMIT 1) AS last_id,
       ARRAY(SELECT id::text FROM cand ORDER BY id)        AS suspect_ids,
       ARRAY(SELECT id::text FROM locked ORDER BY id)      AS locked_ids
"""

SYNC_COMMIT = "SELECT set_config('synchronous_commit', 'on', true)"
GENERIC_PLANS = "SELECT set_config('plan_cache_mode', current_setting('plan_cache_mode'), true)"

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


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("baseline", "the code as it is"),
        Variant(
            "bs500",
            "batch_size 500 (news) / 500 (catalog)",
            batch_size={"news": 500, "catalog": 500},
        ),
        Variant(
            "bs1000",
            "batch_size 1000 (news) / 1000 (catalog)",
            batch_size={"news": 1000, "catalog": 1000},
        ),
        Variant(
            "bs2000",
            "batch_size 2000 (news) / 2000 (catalog)",
            batch_size={"news": 2000, "catalog": 2000},
        ),
        Variant(
            "bs5000",
            "batch_size 5000 (news) / 5000 (catalog)",
            batch_size={"news": 5000, "catalog": 5000},
        ),
        Variant(
            "lock_all",
            "FullSweep locks every post of the batch (no read-only check first) "
            "and recounts all of them, as the earlier design did",
            sql_full_sweep={"news/full_lock": NEWS_FULL_LOCK_ALL},
        ),
        Variant(
            "lock_all_bs500",
            "lock_all with batch_size 500 (the earlier design and default)",
            sql_full_sweep={"news/full_lock": NEWS_FULL_LOCK_ALL},
            batch_size={"news": 500},
        ),
        Variant(
            "sync_commit",
            "batch transactions wait for their WAL flush (synchronous_commit on)",
            sql={"common/async_commit": SYNC_COMMIT},
        ),
        Variant(
            "generic_apply",
            "catalog/apply keeps the generic plan of the prepared statement",
            sql={"common/custom_plans": GENERIC_PLANS},
        ),
        Variant(
            "noprepare",
            "psycopg prepare_threshold=None: every statement planned with its "
            "parameters (no server-side prepared statement, no generic plan)",
            prepare_threshold=None,
        ),
        Variant(
            "custom_plans",
            "SET plan_cache_mode = force_custom_plan on the worker connection "
            "(statements stay server-side prepared, but are planned with their parameters)",
            session=("SET plan_cache_mode = force_custom_plan",),
        ),
        Variant(
            "catalog_lean_indexes",
            "without the ix_popularity_daily_window index on "
            "popularity_daily_views (the unique index has the same columns)",
            db_setup=("DROP INDEX catalog.ix_popularity_daily_window",),
            db_teardown=(
                "CREATE INDEX ix_popularity_daily_window ON "
                "catalog.popularity_daily_views (card_kind, card_id, run_date DESC)",
                "VACUUM ANALYZE catalog.popularity_daily_views",
            ),
        ),
    )
}


def get(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}") from None


def batch_size(variant: Variant, job: str, default: int) -> int:
    return variant.batch_size.get(job, default)


_ORIGINAL = None


def install(
    variant: Variant, full_sweep: bool = True, labels: dict[str, str] | None = None
) -> dict[str, str]:
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

    @functools.cache
    def patched(name: str) -> str:
        text = overrides.get(name) or original(name)
        labels[text] = name
        return text

    for mod in (db, keyset, lease, news, catalog, jobs):
        if hasattr(mod, "sql"):
            mod.sql = patched
    return labels
