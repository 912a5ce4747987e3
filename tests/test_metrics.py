"""Metrics reach StatsD under the specs' names, with their tags, when Airflow is configured so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from datetime import date, timedelta

from tools.devenv import REPO

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from tools import devenv
    devenv.apply_airflow_env(Path(os.environ["PIN_TEST_HOME"]))
    from tools.rundag import run_dag
    for dag_id, conf in (("news_comment_reconcile", {{"scope": "FullSweep"}}),
                         ("catalog_popularity_recompute", {{}})):
        r = run_dag(dag_id, conf)
        assert r["state"] == "success", r
""")


def test_job_metrics_are_sent_to_statsd(news_db, catalog_db):
    news_db.post(count=5, visible=3)
    card = catalog_db.card(views=9)
    catalog_db.seed_snapshot(card, date.today() - timedelta(days=1), 4)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.5)
    packets: list[str] = []
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                packets.extend(sock.recv(65535).decode().splitlines())
            except OSError:
                pass

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    env = {**os.environ,
           "AIRFLOW__METRICS__STATSD_ON": "True",
           "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
           "AIRFLOW__METRICS__STATSD_PORT": str(sock.getsockname()[1]),
           "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
           "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=str(REPO))], env=env,
                         capture_output=True, text=True, timeout=300)
    stop.set()
    t.join(5)
    sock.close()
    assert out.returncode == 0, out.stderr[-3000:]
    text = "\n".join(packets)
    for line in ("airflow.news_comment_reconcile_posts_reconciled_total:1|c",
                 "airflow.news_comment_reconcile_errors_total:0|c",
                 "airflow.catalog_popularity_recompute_errors_total:0|c",
                 "airflow.news_comment_reconcile_drift_corrected_total:1|c",
                 "airflow.news_comment_reconcile_backlog_remaining:0|g",
                 "airflow.catalog_popularity_recompute_snapshots_total,op=written:1|c",
                 "airflow.catalog_popularity_recompute_cards_total,card_kind=PropertyObject:1|c"):
        assert line in text, f"{line} not in {packets[:50]}"
    for name in ("airflow.news_comment_reconcile_run_duration_ms:",
                 "airflow.news_comment_reconcile_last_success_timestamp_seconds:",
                 "airflow.catalog_popularity_score_staleness_hours:",
                 "airflow.catalog_popularity_recompute_duration_seconds:"):
        assert name in text, f"{name} not in {packets[:50]}"
