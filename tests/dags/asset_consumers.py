"""Consumers of pin-nightly's assets, as another team would write them: scheduled on the asset by
its name, reading the extra of the events (used by tests/test_assets.py)."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, task


def consumer(name: str) -> DAG:
    asset = Asset(name)
    with DAG(
        dag_id=f"consume_{name}",
        schedule=[asset],
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["pin-nightly-consumer"],
    ) as dag:

        @task(inlets=[asset])
        def read(inlet_events=None, triggering_asset_events=None) -> dict:
            return {
                "latest": inlet_events[asset][-1].extra,
                "triggered_by": [e.extra for e in triggering_asset_events[asset]],
            }

        read()
    return dag


scores = consumer("catalog_popularity_scores")
counts = consumer("news_comment_counts")
