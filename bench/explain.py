"""EXPLAIN ANALYZE of the per-batch statements (and of the floors), on a batch in the middle of
the keyset, each inside a transaction that is rolled back.

The full plans go to ``bench/out/explain-<job>-s<scale>.txt``; the returned dict holds each
statement's execution time and its plan text (for the report).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from bench import variants
from bench.common import AS_OF, OUT, scale_tag
from bench.runners import CATALOG_FLOOR_SCORES, CATALOG_FLOOR_SNAPSHOTS, NEWS_FLOOR

EXEC = re.compile(r"Execution Time: ([0-9.]+) ms")
PLAN = re.compile(r"Planning Time: ([0-9.]+) ms")


def _explain(cur, text: str, params: dict, opts: str = "ANALYZE, BUFFERS") -> dict:
    cur.execute(f"EXPLAIN ({opts}) {text}", params)
    plan = "\n".join(r[0] for r in cur.fetchall())
    return _result(plan)


def _result(plan: str) -> dict:
    m, p = EXEC.search(plan), PLAN.search(plan)
    return {
        "ms": float(m.group(1)) if m else None,
        "plan_ms": float(p.group(1)) if p else None,
        "plan": plan,
    }


def _numbered(text: str) -> tuple[str, list[str]]:
    """The statement with its %(name)s parameters as $1, $2, ... and the names in that order."""
    names: list[str] = []

    def sub(m):
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", sub, text).replace("%%", "%"), names


def _generic(cur, text: str) -> str:
    """The generic plan (what a prepared statement may switch to after 5 executions)."""
    numbered, _ = _numbered(text)
    cur.execute("SAVEPOINT g")
    try:
        cur.execute("EXPLAIN (GENERIC_PLAN) " + numbered)
        return "\n".join(r[0] for r in cur.fetchall())
    except Exception as exc:  # noqa: BLE001 - untyped parameters may not resolve
        cur.execute("ROLLBACK TO SAVEPOINT g")
        return f"(no generic plan: {str(exc).splitlines()[0]})"


def _generic_analyze(cur, text: str, types: dict[str, str], params: dict) -> dict:
    """EXPLAIN ANALYZE of the statement as a prepared statement under its generic plan."""
    from psycopg import sql as psql

    numbered, names = _numbered(text)
    cur.execute("DEALLOCATE ALL")
    cur.execute(f"PREPARE pin_bench_g ({', '.join(types[n] for n in names)}) AS {numbered}")
    cur.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    args = psql.SQL(", ").join(
        psql.SQL("{}::{}").format(psql.Literal(params[n]), psql.SQL(types[n])) for n in names
    )
    q = psql.SQL("EXPLAIN (ANALYZE, BUFFERS) EXECUTE pin_bench_g ({})").format(args)
    cur.execute(q.as_string(cur))
    plan = "\n".join(r[0] for r in cur.fetchall())
    cur.execute("DEALLOCATE pin_bench_g")
    return _result(plan)


def _timed(cur, text: str, params: dict, n: int = 5) -> float:
    """Median wall time (ms) of running the statement n times inside savepoints."""
    import statistics
    import time

    times = []
    for _ in range(n):
        cur.execute("SAVEPOINT t")
        t = time.perf_counter()
        cur.execute(text, params)
        if cur.description:
            cur.fetchall()
        times.append((time.perf_counter() - t) * 1000)
        cur.execute("ROLLBACK TO SAVEPOINT t")
    return statistics.median(times)


def _write(job: str, scale: float, out: dict) -> None:
    path = OUT / f"explain-{job}-s{scale_tag(scale)}.txt"
    with open(path, "w") as f:
        for name, e in out.items():
            if isinstance(e, dict) and "plan" in e:
                f.write(f"==== {name}  ({e.get('ms')} ms)\n{e['plan']}\n\n")
            elif isinstance(e, str):
                f.write(f"==== {name}\n{e}\n\n")


def explain_news(dsn: str, scale: float) -> dict:
    import psycopg

    from pin_nightly import news
    from pin_nightly.db import sql

    variants.install(variants.get("baseline"))
    out: dict = {}
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        n = cur.execute("SELECT count(*) FROM news.posts").fetchone()[0]
        after = cur.execute(
            "SELECT id::text FROM news.posts ORDER BY id OFFSET %s LIMIT 1", (n // 2,)
        ).fetchone()[0]
        batch = news.DEFAULTS["batch_size"]
        lock_p = {"after_id": after, "upper_id": None, "limit": batch}
        out["news/full_lock"] = _explain(cur, sql("news/full_lock"), lock_p)
        out["news/full_lock (timed x5)"] = _timed(cur, sql("news/full_lock"), lock_p)
        conn.rollback()
        # statement 2 for a batch's suspects: the drifted posts of the next few batches
        cur.execute(sql("news/full_lock"), {**lock_p, "limit": batch * 5})
        ids = cur.fetchone()[4]
        conn.rollback()
        apply_p = {"ids": ids, "dry_run": False, "sweep_id": 0, "run_id": "explain"}
        out[f"news/apply ({len(ids)} posts)"] = _explain(cur, sql("news/apply"), apply_p)
        conn.rollback()
        out["news/full_lock generic plan"] = _generic(cur, sql("news/full_lock"))
        out["variant lock_all: news/full_lock"] = _explain(cur, variants.NEWS_FULL_LOCK_ALL, lock_p)
        conn.rollback()
        # the plan a prepared statement switches to, at 90 % of the keyset
        late = cur.execute(
            "SELECT id::text FROM news.posts ORDER BY id OFFSET %s LIMIT 1", (n * 9 // 10,)
        ).fetchone()[0]
        late_p = {"after_id": late, "upper_id": None, "limit": batch}
        types = {"after_id": "uuid", "upper_id": "uuid", "limit": "bigint"}
        out["news/full_lock, generic plan, batch at 90 %"] = _generic_analyze(
            cur, sql("news/full_lock"), types, late_p
        )
        out["news/full_lock, custom plan, batch at 90 %"] = _explain(
            cur, sql("news/full_lock"), late_p
        )
        conn.rollback()
        # the DailyWindow candidate scan (materialized once per window sweep)
        sweep_id = cur.execute(
            "INSERT INTO pin_nightly.sweep (job, scope, family, resumable, run_id) "
            "VALUES ('explain', 'DailyWindow', 'DailyWindow', false, 'explain') "
            "RETURNING sweep_id"
        ).fetchone()[0]
        cutoff = datetime.now(UTC) - timedelta(hours=26)
        out["news/window_candidates"] = _explain(
            cur, sql("news/window_candidates"), {"sweep_id": sweep_id, "cutoff": cutoff}
        )
        conn.rollback()
        out["floor (one UPDATE)"] = _explain(cur, NEWS_FLOOR, {})
        conn.rollback()
    _write("news", scale, out)
    return out


def explain_catalog(dsn: str, scale: float) -> dict:
    import psycopg

    from pin_nightly import catalog

    variants.install(variants.get("baseline"))
    out: dict = {}
    d = catalog.DEFAULTS
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        n = cur.execute("SELECT count(*) FROM catalog.property_object_cards").fetchone()[0]
        after = cur.execute(
            "SELECT id::text FROM catalog.property_object_cards ORDER BY id OFFSET %s LIMIT 1",
            (n // 2,),
        ).fetchone()[0]
        lock_sql = catalog.card_sql("lock", "PropertyObject")
        lock_p = {
            "after_id": after,
            "upper_id": None,
            "limit": d["batch_size"],
            "targeted": False,
            "card_ids": [],
        }
        out["catalog/lock"] = _explain(cur, lock_sql, lock_p)
        cur.execute(lock_sql, lock_p)
        rows = [r for r in cur.fetchall() if r[1]]
        apply_sql = catalog.card_sql("apply", "PropertyObject")
        apply_p = {
            "ids": [r[0] for r in rows],
            "views": [r[2] for r in rows],
            "kind": "PropertyObject",
            "as_of": AS_OF.isoformat(),
            "window_days": d["window_days"],
            "half_life": d["half_life_days"],
        }
        out["catalog/apply"] = _explain(cur, apply_sql, apply_p)
        out["catalog/apply (timed x5)"] = _timed(cur, apply_sql, apply_p)
        out["catalog/apply generic plan"] = _generic(cur, apply_sql)
        conn.rollback()
        late = cur.execute(
            "SELECT id::text FROM catalog.property_object_cards ORDER BY id OFFSET %s LIMIT 1",
            (n * 9 // 10,),
        ).fetchone()[0]
        late_p = {**lock_p, "after_id": late}
        types = {
            "after_id": "uuid",
            "upper_id": "uuid",
            "limit": "bigint",
            "targeted": "boolean",
            "card_ids": "uuid[]",
        }
        out["catalog/lock, generic plan, batch at 90 %"] = _generic_analyze(
            cur, lock_sql, types, late_p
        )
        out["catalog/lock, custom plan, batch at 90 %"] = _explain(cur, lock_sql, late_p)
        conn.rollback()
        fp = {"as_of": AS_OF, "window_days": d["window_days"], "half_life": d["half_life_days"]}
        out["floor: snapshots INSERT"] = _explain(cur, CATALOG_FLOOR_SNAPSHOTS, fp)
        out["floor: scores UPDATE"] = _explain(cur, CATALOG_FLOOR_SCORES, fp)
        conn.rollback()
    _write("catalog", scale, out)
    return out
