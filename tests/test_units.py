"""Fast tests of the pure parts of the job code: values in, values out, no database, no Airflow
run. The behaviour on PostgreSQL and through Airflow is tested by the other modules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pin_nightly import catalog, jobs, news, sweeps
from pin_nightly.db import JobConfigError
from tools import rundag

# 2026-11-29 is a Sunday; 03:00 in Moscow is 00:00 UTC.
SUNDAY_NIGHT = datetime(2026, 11, 29, 0, 0, tzinfo=UTC)
MONDAY_NIGHT = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)
POST = "0190a000-0000-7000-8000-000000000001"


@pytest.mark.parametrize(
    "params,instant,scope",
    [
        ({}, SUNDAY_NIGHT, "FullSweep"),
        ({}, MONDAY_NIGHT, "DailyWindow"),
        # Sunday 23:30 UTC is already Monday in Moscow
        ({}, datetime(2026, 11, 29, 23, 30, tzinfo=UTC), "DailyWindow"),
        ({"full_sweep_cron": "0 3 * * 1"}, MONDAY_NIGHT, "FullSweep"),
        # a manual auto run on Sunday afternoon (15:00 in Moscow) is not the night's FullSweep
        ({}, datetime(2026, 11, 29, 12, 0, tzinfo=UTC), "DailyWindow"),
        ({"scope": "FullSweep"}, MONDAY_NIGHT, "FullSweep"),
        ({"scope": "DailyWindow"}, SUNDAY_NIGHT, "DailyWindow"),
        ({"post_ids": [POST.upper().replace("-", "")]}, SUNDAY_NIGHT, "Targeted"),
    ],
)
def test_news_scope_choice(params, instant, scope):
    opts = news.validate_options(params, instant)
    assert opts["effective_scope"] == scope
    if instant.hour == 12 and not params:  # a scheduled run of that day keeps the day's scope
        assert news.validate_options(params, instant, nightly=True)["effective_scope"] == (
            "FullSweep"
        )
    if scope == "Targeted":
        assert opts["post_ids"] == [POST]  # normalized


@pytest.mark.parametrize(
    "params,message",
    [
        ({"lock_ttl_minutes": 20, "max_run_duration_minutes": 20}, "must exceed"),
        ({"full_sweep_cron": "every sunday"}, "full_sweep_cron"),
        ({"post_ids": [POST], "scope": "FullSweep"}, "leave scope at 'auto'"),
    ],
)
def test_news_rules_across_options(params, message):
    with pytest.raises(JobConfigError, match=message):
        news.validate_options(params, MONDAY_NIGHT)


def test_catalog_as_of_date_is_the_utc_day_of_the_run():
    late = datetime(2026, 11, 30, 23, 59, tzinfo=UTC)
    assert catalog.validate_options({}, late)["as_of_date"] == "2026-11-30"
    with pytest.raises(JobConfigError, match="must exceed"):
        catalog.validate_options({"lock_ttl_minutes": 30}, late)


@pytest.mark.parametrize("window,kept", [(1, 30), (30, 30), (45, 45)])
def test_retention_never_keeps_less_than_the_nightly_window(window, kept):
    assert catalog.retention_days({"window_days": window}) == kept


def test_params_defaults_and_deadline_budget_come_from_one_definition(monkeypatch):
    from pin_nightly import jobs

    for job in (news, catalog):
        assert job.DEFAULTS == {k: p.value for k, p in job.PARAMS.items()}
        monkeypatch.delenv(f"PIN_{job.JOB.dag_id.upper()}_RUN_DEADLINE_SECONDS", raising=False)
        budget = jobs.dag_settings(job.JOB, job.PARAMS, "owner")["deadline"][0]
        assert budget.interval == timedelta(minutes=job.PARAMS["lock_ttl_minutes"].value)
        assert all(p.description for p in job.PARAMS.values())


def test_run_instant():
    after = datetime(2026, 12, 1, 5, tzinfo=UTC)
    assert jobs.run_instant(SUNDAY_NIGHT, after) == SUNDAY_NIGHT
    assert jobs.run_instant(None, after) == after


V7_2024 = "0190a000-0000-7000-8000-000000000000"  # uuid v7 of 2024-07-11 04:14:32.960 UTC
V7_2026 = "019b76da-a83a-7b33-bda8-46e4cf58440c"  # 2026-01-01 00:00:00.058 UTC


@pytest.mark.parametrize(
    "lower,upper,label",
    [
        (None, None, "FullSweep#0 (start..end]"),
        # uuid v7: the time span the range covers, as precise as it takes to tell its ends apart
        (V7_2026, None, "FullSweep#0 (2026-01-01..end]"),
        (None, V7_2024, "FullSweep#0 (start..2024-07-11]"),
        (V7_2024, V7_2026, "FullSweep#0 (2024-07-11..2026-01-01]"),
        (
            V7_2026,
            "019b76da-c02b-7000-8000-000000000000",
            "FullSweep#0 (2026-01-01 00:00:00..00:00:06]",
        ),
        (V7_2026, "019b770e-1c3a-7000-8000-000000000000", "FullSweep#0 (2026-01-01 00:00..00:56]"),
        # other ids: their first 8 hex digits
        (V7_2026, "3f2504e0-4f89-41d3-9a0c-0305e82c3301", "FullSweep#0 (019b76da..3f2504e0]"),
    ],
)
def test_range_labels(lower, upper, label):
    rng = {"prefix": "FullSweep", "range_no": 0, "lower_id": lower, "upper_id": upper}
    assert sweeps.range_label(rng) == label


@pytest.mark.parametrize(
    "emit",
    [
        lambda m: m.incr("news_comment_reconcile_posts_reconciled"),  # not declared
        lambda m: m.gauge("news_comment_reconcile_posts_reconciled_total", 1),  # a counter
        lambda m: m.incr("catalog_popularity_recompute_cards_total", 1),  # without its tag
    ],
)
def test_emitters_refuse_undeclared_metrics(emit):
    from pin_nightly import metrics

    with pytest.raises(metrics.UnknownMetric):
        emit(metrics)


@pytest.mark.parametrize("name", rundag.AIRFLOW_INTERNALS)
def test_the_airflow_internals_the_harness_uses_are_there(name):
    """tools/rundag.py drives dag.test(), clears and the metadata database through these, and
    the job package uses a few; after an Airflow upgrade this names the one that moved."""
    import importlib

    module, _, path = name.partition(":")
    obj = importlib.import_module(module)
    for attr in path.split("."):
        assert hasattr(obj, attr), f"{name}: Airflow no longer has {attr!r} (AIRFLOW_INTERNALS)"
        obj = getattr(obj, attr)


def test_run_over_budget_waits_for_a_runs_own_budget(monkeypatch):
    """The deadline fires at the DAG's default budget of the run's being queued; a run given a
    larger lock_ttl_minutes is over budget only past its own, and a run queued behind another
    only past its budget from its start: reported if still running then, not if it ended
    before."""
    import asyncio

    from pin_nightly import deadlines

    states: list[str] = []

    async def run_state(dag_id, run_id):
        return states.pop(0)

    monkeypatch.setattr(deadlines, "_run_state", run_state)

    def context(ttl, queued_ago: float) -> dict:
        queued = datetime.now(UTC) - timedelta(seconds=queued_ago)
        run = {"dag_id": "d", "dag_run_id": "r", "queued_at": queued.isoformat(), "conf": {}}
        if ttl is not None:
            run["conf"]["lock_ttl_minutes"] = ttl
        return {"dag_run": run}

    check = deadlines.within_own_budget
    # the default budget, or a smaller one: reported as it fires, nothing asked
    assert asyncio.run(check(context(None, 60), 30)) == (False, 30)
    assert asyncio.run(check(context(0.1, 60), 30)) == (False, 30)
    # a run that ends within its own 3 minutes: no alert
    states[:] = ["running", "success"]
    assert asyncio.run(check(context(3, 1), 2, poll=0.01)) == (True, 180)
    # a run still running past its own 3 s: reported with its own budget and state
    states[:] = ["running"] * 1000
    ctx = context(0.05, 1)
    assert asyncio.run(check(ctx, 2, poll=0.2)) == (False, 3.0)
    assert ctx["dag_run"]["state"] == "running"
    assert deadlines.own_budget_seconds({"dag_run": {"conf": {"lock_ttl_minutes": True}}}) is None
    # queued 60 s behind another run, started 1 s ago: within its 2 s, and it ends in time
    late = context(None, 60)
    late["dag_run"]["start_date"] = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    states[:] = ["running", "success"]
    assert asyncio.run(check(late, 2, poll=0.01)) == (True, 2)
    # still queued when the deadline fires: its budget starts when it does
    waiting = context(None, 60)
    waiting["dag_run"]["start_date"] = None
    states[:] = ["queued", "queued", "running", "running", "success"]
    assert asyncio.run(check(waiting, 2, poll=0.01)) == (True, 2)
    # a TTL raised through the deployment's settings Variable counts as the run's own
    monkeypatch.setenv("AIRFLOW_VAR_PIN_NIGHTLY_D", '{"lock_ttl_minutes": 3}')
    states[:] = ["running", "success"]
    assert asyncio.run(check(context(None, 1), 2, poll=0.01)) == (True, 180)
    monkeypatch.delenv("AIRFLOW_VAR_PIN_NIGHTLY_D")
    # and one that runs past its budget once started is reported
    states[:] = ["queued", *["running"] * 1000]
    over = context(None, 60)
    over["dag_run"]["start_date"] = None
    assert asyncio.run(check(over, 0.3, poll=0.05)) == (False, 0.3)


def _range(lo, hi, status="pending", cursor=None, wrap_at=None, wrapped=False):
    return {"lower_id": lo, "upper_id": hi, "status": status, "cursor_id": cursor} | {
        "wrap_at": wrap_at,
        "wrapped": wrapped,
    }


def _covers_the_keyset_once(ranges):
    """The ranges (lower, upper] partition the whole keyset: sorted, each starts where the
    previous one ended, the first at the start and the last at the end."""
    parts = sorted(ranges, key=lambda r: (r[0] is not None, r[0] or ""))
    assert parts[0][0] is None and parts[-1][1] is None, parts
    assert all(a[1] == b[0] and a[1] is not None for a, b in zip(parts, parts[1:])), parts


def test_a_cut_sweep_leaves_every_ranges_tail_first_in_the_next_plan():
    # four ranges worked at once, each cut half-way: the next plan starts with all four tails
    previous = [
        _range(None, "b", cursor="a"),
        _range("b", "d", cursor="c"),
        _range("d", "f", cursor="e"),
        _range("f", None, cursor="g"),
    ]
    unreached, reached = sweeps.coverage(previous)
    assert unreached == [("a", "b"), ("c", "d"), ("e", "f"), ("g", None)]
    assert reached == [(None, "a"), ("b", "c"), ("d", "e"), ("f", "g")]
    fresh = [(None, "b"), ("b", "d"), ("d", "f"), ("f", None)]
    out = sweeps.rotated(fresh, unreached, reached)
    assert [(a, b) for a, b, _, u in out if u] == unreached
    assert [u for *_, u in out] == [True] * 4 + [False] * 4
    _covers_the_keyset_once(out)


def test_one_slot_rotation_goes_on_where_the_queue_stopped():
    # one slot: the first range done, the second cut, the rest untouched; the part of the
    # second it reached and the first come last
    previous = [
        _range(None, "b", status="done"),
        _range("b", "d", cursor="c"),
        _range("d", "f"),
        _range("f", None),
    ]
    unreached, reached = sweeps.coverage(previous)
    assert unreached == [("c", None)] and reached == [(None, "c")]
    out = sweeps.rotated([(None, "b"), ("b", "d"), ("d", "f"), ("f", None)], unreached, reached)
    assert [(a, b) for a, b, *_ in out] == [("c", "d"), ("d", "f"), ("f", None), (None, "b")] + [
        ("b", "c")
    ]
    _covers_the_keyset_once(out)


def test_a_rotated_range_of_an_earlier_release_is_read_as_it_ran():
    # (wrap_at, upper] first, then (lower, wrap_at]: cut before and after the wrap
    before = sweeps.coverage([_range("b", "f", cursor="e", wrap_at="d"), _range("f", None)])
    assert before == ([("e", "f"), ("b", "d"), ("f", None)], [("d", "e")])
    after = sweeps.coverage([_range(None, "f", cursor="b", wrap_at="d", wrapped=True)])
    assert after == ([("b", "d")], [(None, "b"), ("d", "f")])


def test_the_budget_share_is_written_once_and_put_in_place_where_it_is_read():
    """The share of the run's budget a range may use: one SQL fragment, which the fence (no new
    batch past it) and the health reading (seconds left to pause) both expand."""
    from pin_nightly.db import sql, sql_dir

    fragment = sql("common/share_deadline").strip().splitlines()[-1]
    assert "%(budget_share)s" in fragment
    blocks = [
        block.split()[0]
        for path in sql_dir().rglob("*.sql")
        for block in path.read_text().split("-- name: ")
        if "%(budget_share)s" in block
    ]
    assert blocks == ["share_deadline"]
    for statement in ("common/lease_fence", "health/signals"):
        assert fragment in sql(statement) and "{common/" not in sql(statement)
