"""What partitioning the snapshot table by ``run_date`` would change: ``python -m
bench.partition --scale 1`` (after a ``make bench`` of that scale; results are added to its
results file, under ``catalog.partitioned``).

A copy of the catalog database whose ``catalog.popularity_daily_views`` is range-partitioned by
day (the same columns and indexes; the primary key becomes ``(id, run_date)``, as a partitioned
table requires). Measured there like the benchmark measures: the popularity run with one range
(the job's code and SQL unchanged), interleaved with the same run on the plain table (the two
must write the same), and, instead of retention's ``DELETE``, the ``DROP`` of the oldest
night's partition.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

from bench import data, run, runners
from bench.common import AS_OF, OUT, catalog_db, scale_tag, setup_airflow_env

COLUMNS = """id uuid NOT NULL DEFAULT gen_random_uuid(),
    card_kind varchar(16) NOT NULL CHECK (card_kind IN ('PropertyObject', 'Project')),
    card_id uuid NOT NULL, run_date date NOT NULL,
    cumulative_views bigint NOT NULL CHECK (cumulative_views >= 0),
    created_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (id, run_date)"""


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.partition")
    ap.add_argument("--scale", type=float, default=1.0)
    scale = ap.parse_args().scale
    setup_airflow_env()
    import psycopg

    from tools import devenv

    name = f"pin_bench_part_s{scale_tag(scale)}"
    with psycopg.connect(devenv.admin_dsn(), autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}" TEMPLATE "{catalog_db(scale)}"')
    dsn = devenv.dsn_for(name)
    data.reset_catalog(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SET maintenance_work_mem = '1GB'")
        c.execute("ALTER TABLE catalog.popularity_daily_views RENAME TO plain_views")
        c.execute("ALTER INDEX catalog.popularity_daily_views_pkey RENAME TO plain_views_pkey")
        c.execute(
            f"CREATE TABLE catalog.popularity_daily_views ({COLUMNS}) PARTITION BY RANGE (run_date)"
        )
        for age in range(-3, 40):
            d = AS_OF - timedelta(days=age)
            c.execute(
                f"CREATE TABLE catalog.views_{d:%Y%m%d} PARTITION OF catalog.popularity_daily_"
                f"views FOR VALUES FROM ('{d}') TO ('{d + timedelta(days=1)}')"
            )
        c.execute(
            "INSERT INTO catalog.popularity_daily_views SELECT * FROM "
            "catalog.plain_views ORDER BY run_date, card_kind, card_id"
        )
        c.execute("DROP TABLE catalog.plain_views")
        devenv.run_sql_file(dsn, "schema/catalog_popularity.sql")  # the indexes
        for age in range(-3, 40):
            d = AS_OF - timedelta(days=age)
            c.execute(f"ALTER TABLE catalog.views_{d:%Y%m%d} SET (autovacuum_enabled = off)")
        c.execute("VACUUM ANALYZE")
    plain = devenv.dsn_for(catalog_db(scale))
    path = OUT / f"results_s{scale_tag(scale)}.json"
    results = json.loads(path.read_text())
    out = {"job_1": [], "plain_job_1": [], "drop_partition": []}
    checks = {}
    for key, db in (("plain_job_1", plain), ("job_1", dsn)):
        os.environ["AIRFLOW_CONN_CATALOG_DB"] = devenv.airflow_connection(db)
        pool = runners.Pool(1, db, "partition")
        data.reset_catalog(db)
        out[key].append(run.measure(lambda pool=pool: runners.run_catalog(pool, 1), db))
        pool.close()
        checks[key] = data.catalog_checksum(db)
        print(key, out[key][-1]["seconds"], out[key][-1]["footprint"], flush=True)
    out["same_result"] = checks["job_1"] == checks["plain_job_1"]
    oldest = AS_OF - timedelta(days=31)

    def drop() -> dict:
        with psycopg.connect(dsn, autocommit=True) as c:
            n = c.execute(
                "SELECT count(*) FROM catalog.popularity_daily_views WHERE run_date = %s", (oldest,)
            ).fetchone()[0]
            t = time.perf_counter()
            c.execute(f"DROP TABLE catalog.views_{oldest:%Y%m%d}")
            dt = time.perf_counter() - t
        return {"seconds": dt, "rows": n, "changed": n, "batch_ms": [dt * 1000]}

    out["drop_partition"].append(run.measure(drop, dsn))
    print("drop", out["drop_partition"][-1])
    results["catalog"]["partitioned"] = out
    path.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
