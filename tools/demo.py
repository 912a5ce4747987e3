"""make demo: both DAGs through Airflow on an embedded PostgreSQL, and what they did."""

from __future__ import annotations

import os
import sys
import time
from datetime import UTC, datetime, timedelta

from tools import devenv

HOME = devenv.REPO / ".airflow" / "demo"


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    heads = [h for h, _ in columns]
    cells = [[_fmt(r.get(k)) for _, k in columns] for r in rows]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)
    ]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths)) + " |", line]
    out += [
        "| "
        + " | ".join(
            c.rjust(w) if c.replace(".", "").isdigit() else c.ljust(w) for c, w in zip(row, widths)
        )
        + " |"
        for row in cells
    ]
    out.append(line)
    return "\n".join(out)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def datagen_demo_news() -> dict:
    """The demo's news volumes (also ``make airflow``'s): 5000 posts, ~3 % drifted counters."""
    return {"posts": 5000, "comments": 20000, "drift": 0.03, "recent": 0.02}


def datagen_demo_catalog(as_of) -> dict:
    """The demo's catalog volumes (also ``make airflow``'s): 3200 cards, 31 nights."""
    return {"property_objects": 3000, "projects": 200, "as_of": as_of}


def say(msg: str) -> None:
    print(msg, flush=True)


def news_demo() -> list[dict]:
    import psycopg

    from tools import datagen
    from tools.rundag import run_dag

    dsn = devenv.recreate_database("pin_demo_news")
    made = datagen.news(dsn, **datagen_demo_news())
    os.environ["AIRFLOW_CONN_NEWS_DB"] = devenv.airflow_connection(dsn)
    say(
        f"news data: {made['posts']} posts ({made['archived']} archived), {made['comments']} "
        f"comments (visible, hidden, deleted), {made['drifted']} drifted counters, "
        f"{made['comments_changed_recently']} comments changed in the last 25 hours"
    )

    runs = []

    def go(title: str, conf: dict) -> dict:
        started = time.monotonic()
        r = run_dag("news_comment_reconcile", conf)
        s = r["summary"] or {}
        row = {
            "run": title,
            "state": r["state"],
            **s,
            "wall_s": f"{time.monotonic() - started:.1f}",
        }
        runs.append(row)
        return row

    go("1 DailyWindow", {"scope": "DailyWindow"})
    go("2 FullSweep", {"scope": "FullSweep"})
    go("3 FullSweep again", {"scope": "FullSweep"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        # the hot path loses a decrement on a few posts: a targeted repair, dry run first
        ids = [
            r[0]
            for r in conn.execute(
                "UPDATE news.posts SET comments_count = comments_count + 1 WHERE id IN (SELECT id "
                "FROM news.posts WHERE status <> 'Archived' ORDER BY id DESC LIMIT 3) "
                "RETURNING id::text"
            ).fetchall()
        ]
        say(
            "\nbetween runs 3 and 4 the demo makes the hot path lose a decrement on 3 posts "
            "(comments_count + 1): runs 4 and 5 are a targeted dry run and repair of them"
        )
        go("4 post_ids dry run", {"post_ids": ids, "dry_run": True})
        go("5 post_ids repair", {"post_ids": ids})
        left = conn.execute(
            "SELECT count(*) FROM news.posts p WHERE p.status <> 'Archived' AND "
            "p.comments_count <> (SELECT count(*) FROM news.comments c "
            "WHERE c.post_id = p.id AND c.status = 'Visible')"
        ).fetchone()[0]
        sample = conn.execute(
            "SELECT post_id::text, count_from, count_to, dry_run FROM pin_nightly.news_drift "
            "ORDER BY recorded_at LIMIT 5"
        ).fetchall()
    say("\nnews_comment_reconcile runs (through Airflow, dag.test):")
    say(
        table(
            runs,
            [
                ("run", "run"),
                ("state", "state"),
                ("scope", "scope"),
                ("dry", "dry_run"),
                ("reconciled", "posts_reconciled"),
                ("drift found", "drift_found"),
                ("drift fixed", "drift_corrected"),
                ("batches", "batches_processed"),
                ("skipped locked", "posts_skipped_locked"),
                ("backlog", "backlog_remaining"),
                ("job ms", "duration_ms"),
                ("wall s", "wall_s"),
            ],
        )
    )
    say("first corrections recorded in pin_nightly.news_drift (post, from -> to):")
    for pid, a, b, dry in sample:
        say(f"  {pid}  {a} -> {b}{'  (dry run)' if dry else ''}")
    say(f"posts whose counter differs from their visible comments now: {left}")
    return runs


def catalog_demo() -> list[dict]:
    import psycopg

    from tools import datagen
    from tools.rundag import run_dag

    today = datetime.now(UTC).date()
    dsn = devenv.recreate_database("pin_demo_catalog")
    made = datagen.catalog(dsn, **datagen_demo_catalog(today))
    os.environ["AIRFLOW_CONN_CATALOG_DB"] = devenv.airflow_connection(dsn)
    say(
        f"\ncatalog data: {made['cards']} cards (property objects and projects, 5 % Delisted), "
        f"{made['snapshots']} snapshots over the 31 nights before today (3 missed), "
        f"{made['poison']} poison cards"
    )
    say(
        f"the {made['poison']} poison cards (NULL and negative popularity_views) are logged at "
        "ERROR as 'item failed' on purpose, in each run that reaches them"
    )
    logical = datetime(today.year, today.month, today.day, 3, tzinfo=UTC)
    runs = []
    for title, conf, when in (
        ("1 tonight", {}, logical),
        ("2 tonight again", {}, logical),
        ("3 yesterday (backfill)", {}, logical - timedelta(days=1)),
    ):
        started = time.monotonic()
        r = run_dag("catalog_popularity_recompute", conf, logical_date=when)
        runs.append(
            {
                "run": title,
                "state": r["state"],
                **(r["summary"] or {}),
                "wall_s": f"{time.monotonic() - started:.1f}",
            }
        )
    say("\ncatalog_popularity_recompute runs (through Airflow, dag.test):")
    say(
        table(
            runs,
            [
                ("run", "run"),
                ("state", "state"),
                ("as_of_date", "as_of_date"),
                ("PO updated", "property_object_cards_updated"),
                ("projects updated", "project_cards_updated"),
                ("snapshots", "snapshots_written"),
                ("pruned", "snapshots_pruned"),
                ("item errors", "item_errors"),
                ("backlog", "backlog_remaining"),
                ("job ms", "duration_ms"),
                ("wall s", "wall_s"),
            ],
        )
    )
    say(
        f"   run 2: the {runs[1].get('snapshots_written')} snapshots are re-upserts of the same "
        "counters (the date's snapshot is rewritten), no score changed\n"
        "   run 3: " + runs[2].get("status", "?")
    )
    with psycopg.connect(dsn) as conn:
        top = conn.execute(
            "SELECT 'PropertyObject', id::text, popularity_views, popularity_score "
            "FROM catalog.property_object_cards UNION ALL SELECT 'Project', id::text, "
            "popularity_views, popularity_score FROM catalog.project_cards "
            "ORDER BY popularity_score DESC LIMIT 5"
        ).fetchall()
    say("most popular cards now (kind, id, views, score):")
    for kind, cid, views, score in top:
        say(f"  {kind:<15} {cid}  {views:>8}  {score}")
    return runs


def _quiet_library_logs() -> None:
    """Airflow's own warnings are noise here (a deprecation inside a library, dag.test()
    polling for the next runnable task); the jobs' warnings and errors stay."""
    import logging
    import warnings

    import airflow.settings  # noqa: F401 - configures logging and warnings first

    warnings.filterwarnings("ignore", category=DeprecationWarning)

    for name in ("py.warnings", "airflow.sdk.definitions.dag", "airflow.models.dagrun"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("PIN_LOG_LEVEL", "WARNING")
    devenv.apply_airflow_env(HOME)
    started = time.monotonic()
    say(
        f"PostgreSQL: {'PIN_PG_DSN' if os.environ.get('PIN_PG_DSN') else 'embedded (.pgdata/)'}"
        f"; Airflow home: {HOME.relative_to(devenv.REPO)} (SQLite metadata)"
    )
    devenv.init_airflow(HOME)
    _quiet_library_logs()
    news_runs = news_demo()
    catalog_runs = catalog_demo()
    ok = all(r["state"] == "success" for r in news_runs + catalog_runs)
    ok &= news_runs[2]["drift_corrected"] == 0
    ok &= catalog_runs[1]["property_object_cards_updated"] == 0
    ok &= catalog_runs[2]["snapshots_written"] == 0
    say(
        f"\ndemo finished in {time.monotonic() - started:.0f} s at "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC: "
        f"{'all runs succeeded; the repeated runs changed nothing' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
