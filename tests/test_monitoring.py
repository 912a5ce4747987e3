"""The monitoring files (statsd-exporter mapping, Prometheus config and rules, Grafana dashboard)
agree with the metrics the code emits: the table ``pin_nightly.metrics.METRICS`` (the emitters
refuse any other name). PromQL expressions are read with ``promql-parser``.

Pure file checks: no database, no Airflow run, no network.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from pin_nightly import deadlines

REPO = Path(__file__).resolve().parents[1]
MON = REPO / "include" / "monitoring"
MAPPING = MON / "statsd_mapping.yml"
PROM_DIR = MON / "prometheus"
ALERTS = PROM_DIR / "alerts.yml"
PROMETHEUS = PROM_DIR / "prometheus.yml"
DASHBOARD = MON / "grafana" / "pin-nightly-dashboard.json"
# docker-compose mounts include/monitoring/prometheus/ here
PROM_MOUNT = "/etc/prometheus/"
SCRAPE_TARGET = "statsd-exporter:9102"

# [metrics] statsd_prefix that the mapping documents and matches
STATSD_PREFIX = "airflow"
# The Airflow settings the mapping's header must document (name -> value, None: any value).
AIRFLOW_SETTINGS = {
    "STATSD_ON": "True",
    "STATSD_HOST": None,
    "STATSD_PORT": "9125",
    "STATSD_PREFIX": STATSD_PREFIX,
    "STATSD_INFLUXDB_ENABLED": "True",
}

HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
TARGET_LABELS = {"job", "instance"}  # added by the Prometheus scrape


# ------------------------------------------------------------------------ emitted metrics
@dataclass
class Emitted:
    kind: str  # counter | gauge | timer
    tags: set[str] = field(default_factory=set)


@pytest.fixture(scope="module")
def emitted() -> dict[str, Emitted]:
    from pin_nightly.metrics import METRICS

    return {name: Emitted(m.kind, set(m.tags)) for name, m in METRICS.items()}


def exposed_series(emitted: dict[str, Emitted]) -> dict[str, str]:
    """Prometheus series name -> emitted metric: a timer is a histogram (_bucket/_count/_sum)."""
    out = {}
    for name, e in emitted.items():
        if e.kind == "timer":
            out.update({name + s: name for s in HISTOGRAM_SUFFIXES})
        else:
            out[name] = name
    return out


@dataclass
class PromQL:
    metrics: set[str]
    labels: set[str]  # label names used in matchers and by/on/group_left/... clauses


def parse_promql(expr: str) -> PromQL:
    """Metric names and label names of a PromQL expression (Grafana variables allowed)."""
    import promql_parser

    text = re.sub(r"\$\{[^}]*\}|\$\w+", "5m", expr)  # $__rate_interval, ${x}: durations here
    metrics: set[str] = set()
    labels: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                metrics.add(node.name)
            labels.update(m.name for m in node.matchers.matchers if m.name != "__name__")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier:
            if node.modifier.matching:
                labels.update(node.modifier.matching.labels)
            labels.update(node.modifier.group_labels or [])

    promql_parser.walk(promql_parser.parse(text), visit)
    return PromQL(metrics, labels)


# ------------------------------------------------------------------------------ helpers
_DURATION = re.compile(r"(\d+)(ms|y|w|d|h|m|s)")
_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}


def seconds(duration: str | None) -> float:
    if not duration:
        return 0
    parts = _DURATION.findall(str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(int(n) * _UNIT[u] for n, u in parts)


def _norm(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).strip()


def check_references(where: str, expr: str, emitted: dict[str, Emitted]) -> list[str]:
    """Problems of one expression: unknown metrics, labels the code does not send."""
    q = parse_promql(expr)
    series = exposed_series(emitted)
    problems = []
    if not q.metrics:
        problems.append(f"{where}: no metric found in {expr!r}")
    allowed = set(TARGET_LABELS)
    for name in sorted(q.metrics):
        if name not in series:
            hint = " (a timer: use _bucket/_count/_sum)" if emitted.get(name, None) else ""
            problems.append(f"{where}: {name} is not a metric the code emits{hint}")
            continue
        allowed |= emitted[series[name]].tags
        if name.endswith("_bucket"):
            allowed.add("le")
    if q.labels - allowed:
        problems.append(
            f"{where}: labels {sorted(q.labels - allowed)} are not sent with "
            f"{sorted(q.metrics)} (tags: {sorted(allowed - TARGET_LABELS)})"
        )
    return problems


# ---------------------------------------------------------------------------- the files
@pytest.fixture(scope="module")
def mapping() -> dict:
    doc = yaml.safe_load(MAPPING.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("mappings"), list) and doc["mappings"]
    return doc


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert isinstance(doc, dict) and doc.get("groups"), "alerts.yml has no groups"
    out = []
    for group in doc["groups"]:
        assert group.get("name") and group.get("rules"), group
        out += group["rules"]
    return out


@pytest.fixture(scope="module")
def alerts(rules) -> list[dict]:
    found = [r for r in rules if "alert" in r]
    assert found, "alerts.yml has no alerting rule"
    return found


@pytest.fixture(scope="module")
def prometheus() -> dict:
    doc = yaml.safe_load(PROMETHEUS.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def dashboard() -> dict:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict) and doc.get("panels")
    return doc


def dashboard_panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # panels of a collapsed row
    return out


def dashboard_targets(dash: dict) -> list[tuple[str, dict]]:
    return [(p.get("title", "?"), t) for p in dashboard_panels(dash) for t in p.get("targets", [])]


# ------------------------------------------------------------------- statsd-exporter mapping
def _exporter_map(statsd_name: str, statsd_type: str, doc: dict):
    """(index, metric name) of the rule prom/statsd-exporter applies, or (None, None).

    Glob rules first (in file order; ``*`` is one whole dot-separated field), then regex rules
    (unanchored search, like the exporter's FindStringSubmatchIndex)."""
    defaults = doc.get("defaults") or {}
    rules_ = list(enumerate(doc["mappings"]))

    def kind_ok(m):
        return m.get("match_metric_type") in (None, statsd_type)

    def expand(template: str, groups) -> str:
        return re.sub(r"\$\{?(\d+)\}?", lambda g: groups[int(g.group(1)) - 1] or "", template)

    for i, m in rules_:
        if m.get("match_type", defaults.get("match_type", "glob")) != "glob" or not kind_ok(m):
            continue
        pattern, fields = m["match"].split("."), statsd_name.split(".")
        if len(pattern) == len(fields) and all(p in ("*", f) for p, f in zip(pattern, fields)):
            caps = [f for p, f in zip(pattern, fields) if p == "*"]
            return i, expand(m["name"], caps)
    for i, m in rules_:
        if m.get("match_type", defaults.get("match_type", "glob")) != "regex" or not kind_ok(m):
            continue
        hit = re.search(m["match"], statsd_name)
        if hit:
            return i, expand(m["name"], hit.groups())
    return None, None


STATSD_TYPE = {"counter": "counter", "gauge": "gauge", "timer": "observer"}


def test_mapping_documents_the_airflow_settings():
    header = "\n".join(
        line for line in MAPPING.read_text().splitlines() if line.lstrip().startswith("#")
    )
    documented = dict(re.findall(r"AIRFLOW__METRICS__(\w+)=(\S*)", header))
    for option, value in AIRFLOW_SETTINGS.items():
        assert option in documented, f"AIRFLOW__METRICS__{option} is not documented"
        if value is not None:
            assert documented[option] == value, (option, documented[option])
    # every documented option is a real [metrics] option of this Airflow
    spec = importlib.util.find_spec("airflow")
    config_yml = (
        Path(next(iter(spec.submodule_search_locations))) / "config_templates" / "config.yml"
    )
    options = yaml.safe_load(config_yml.read_text())["metrics"]["options"]
    unknown = {o for o in documented if o.lower() not in options}
    assert not unknown, f"not options of [metrics] in {config_yml}: {unknown}"


def test_every_emitted_metric_is_mapped_to_its_own_name(mapping, emitted):
    problems = []
    for name, e in sorted(emitted.items()):
        index, produced = _exporter_map(f"{STATSD_PREFIX}.{name}", STATSD_TYPE[e.kind], mapping)
        if index is None:
            problems.append(f"{name} ({e.kind}): no mapping rule")
            continue
        rule = mapping["mappings"][index]
        if rule.get("action", "map") != "map":
            problems.append(f"{name}: rule {rule['match']} drops it")
        if produced != name:
            problems.append(f"{name}: mapped to {produced!r}")
        if e.kind == "timer":
            observer = rule.get(
                "observer_type", (mapping.get("defaults") or {}).get("observer_type")
            )
            buckets = (rule.get("histogram_options") or {}).get("buckets") or rule.get("buckets")
            if observer != "histogram":
                problems.append(f"{name}: timer is not a histogram (observer_type {observer})")
            elif not buckets or list(buckets) != sorted(set(buckets)):
                problems.append(f"{name}: histogram buckets missing or not ascending: {buckets}")
            # the exporter turns StatsD ms into seconds: a name in ms must be scaled back
            scale = rule.get("scale", 1)
            if name.endswith("_ms") and scale != 1000:
                problems.append(f"{name}: named in ms but scale is {scale} (seconds)")
            if name.endswith("_seconds") and scale != 1:
                problems.append(f"{name}: named in seconds but scale is {scale}")
    assert not problems, "\n".join(problems)


def test_every_mapping_rule_maps_an_emitted_metric(mapping, emitted):
    used = {}
    for name, e in emitted.items():
        index, produced = _exporter_map(f"{STATSD_PREFIX}.{name}", STATSD_TYPE[e.kind], mapping)
        if index is not None:
            used.setdefault(index, set()).add(produced)
    problems = []
    for i, rule in enumerate(mapping["mappings"]):
        where = f"mapping #{i} ({rule.get('match')})"
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*|.*\$.*", str(rule.get("name", ""))):
            problems.append(f"{where}: invalid metric name {rule.get('name')!r}")
        if (
            not str(rule.get("match", "")).startswith(STATSD_PREFIX + ".")
            and rule.get("match_type") != "regex"
        ):
            problems.append(f"{where}: does not match under the prefix {STATSD_PREFIX}.")
        if i not in used:
            problems.append(f"{where}: matches no metric the code emits")
        elif not used[i] <= set(emitted):
            problems.append(f"{where}: produces {sorted(used[i] - set(emitted))}, not emitted")
        if seconds(rule.get("ttl", (mapping.get("defaults") or {}).get("ttl", 0))):
            problems.append(f"{where}: a ttl expires the nightly gauges between runs")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------- Prometheus config
def test_prometheus_scrapes_the_exporter_and_loads_the_rules(prometheus):
    targets = [
        t
        for job in prometheus.get("scrape_configs") or []
        for sc in job.get("static_configs") or []
        for t in sc.get("targets") or []
    ]
    assert SCRAPE_TARGET in targets, targets
    rule_files = prometheus.get("rule_files") or []
    assert PROM_MOUNT + ALERTS.name in rule_files, rule_files
    for path in rule_files:
        assert path.startswith(PROM_MOUNT), f"{path} is outside the mounted {PROM_MOUNT}"
        local = PROM_DIR / path[len(PROM_MOUNT) :]
        assert local.is_file(), f"{path}: no {local.relative_to(REPO)} to mount"
        assert yaml.safe_load(local.read_text()).get("groups"), f"{local} has no rule groups"


# ------------------------------------------------------------------------------- alerts
SEVERITIES = {"critical", "warning", "info"}
RUNBOOK = REPO / "docs" / "runbook.md"


def runbook_anchors() -> set[str]:
    """The anchors of the runbook's headings, as GitHub makes them (lower case): a rule links
    to the page (``#runbook``, its title) or to its own section (``#<AlertName>``)."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", RUNBOOK.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_alert_has_severity_summary_description_and_runbook(alerts):
    problems = []
    anchors = runbook_anchors()
    names = [a["alert"] for a in alerts]
    problems += [f"duplicate alert name {n}" for n in sorted(set(names)) if names.count(n) > 1]
    for a in alerts:
        where = a.get("alert")
        labels, ann = a.get("labels") or {}, a.get("annotations") or {}
        if not str(a.get("expr", "")).strip():
            problems.append(f"{where}: no expr")
        if labels.get("severity") not in SEVERITIES:
            problems.append(f"{where}: severity {labels.get('severity')!r} not in {SEVERITIES}")
        for key in ("summary", "description"):
            if not str(ann.get(key, "")).strip():
                problems.append(f"{where}: no {key} annotation")
        runbook = ann.get("runbook_url") or ann.get("runbook")
        link = re.fullmatch(r"docs/runbook\.md#(\S+)", str(runbook))
        if not link or link.group(1).lower() not in anchors:
            problems.append(
                f"{where}: runbook annotation {runbook!r} does not point at a heading of "
                f"{RUNBOOK.relative_to(REPO)}"
            )
        try:
            seconds(a.get("for"))
        except AssertionError:
            problems.append(f"{where}: bad for: {a.get('for')!r}")
    assert not problems, "\n".join(problems)


def test_alert_expressions_use_only_emitted_metrics_and_tags(rules, emitted):
    problems = []
    for r in rules:
        problems += check_references(r.get("alert") or r.get("record"), r["expr"], emitted)
    assert not problems, "\n".join(problems)


NEWS = "news_comment_reconcile"
CATALOG = "catalog_popularity_recompute"
STALE_SECONDS = deadlines.STALE_SECONDS
DEADLINE_KINDS = {a.name for a in deadlines.deadline_alerts(NEWS, 1)}
STALENESS_HOURS = 30
BACKLOG_SECONDS = 2 * 86400


def _compares(expr: str, lhs: str, value: float) -> bool:
    """``lhs ... > N`` with N (a number or a product of numbers) equal to value."""
    for m in re.finditer(re.escape(lhs) + r"[^<>]*?>\s*([\d.]+(?:\s*\*\s*[\d.]+)*)(?![\w.])", expr):
        product = 1.0
        for factor in re.split(r"\s*\*\s*", m.group(1)):
            product *= float(factor)
        if product == value:
            return True
    return False


def _no_success(job):
    metric = f"{job}_last_success_timestamp_seconds"
    return lambda a, e: "time()" in e and _compares(e, metric, STALE_SECONDS)


def _errors_grow(job):
    return lambda a, e: re.search(
        rf"(?:rate|increase)\(\s*{job}_errors_total\b[^)]*\)\s*>\s*0\b", e
    )


def _backlog(job):
    metric = f"{job}_backlog_remaining"

    def check(a, e):
        if re.search(rf"\b{metric}\s*(?:==\s*1|>\s*0)\b", e):
            return seconds(a.get("for")) >= BACKLOG_SECONDS
        window = re.search(rf"min_over_time\(\s*{metric}\s*\[(\w+)\]\s*\)\s*(?:==\s*1|>\s*0)", e)
        return bool(window) and seconds(window.group(1)) >= BACKLOG_SECONDS

    return check


def _deadline_misses(a, e):
    return re.search(
        r"(?:rate|increase)\(\s*pin_nightly_deadline_missed_total\b[^)]*\)\s*>\s*0\b", e
    )


SPEC_ALERTS = {
    # compares with the run's own threshold, emitted as a gauge
    "news: drift above the threshold in a run": lambda a, e: re.search(
        rf"\b{NEWS}_last_run_drift_corrected\s*>\s*{NEWS}_drift_alert_threshold\b", e
    ),
    # most of a night's corrections of one sign, and several times the median night of a week
    "news: one-sided drift several times a usual night": lambda a, e: (
        re.search(rf"\b{NEWS}_last_run_drift\b", e)
        and re.search(
            rf"quantile_over_time\(\s*0\.5\s*,\s*{NEWS}_last_run_drift_corrected\[7d\]\s*\)", e
        )
    ),
    "news: no successful run for more than 26 h": _no_success(NEWS),
    "news: errors_total grows": _errors_grow(NEWS),
    "news: backlog not draining for 2 days": _backlog(NEWS),
    "catalog: no successful run for more than 26 h": _no_success(CATALOG),
    "catalog: errors_total rate > 0, sustained": lambda a, e: (
        seconds(a.get("for")) > 0
        and re.search(rf"\brate\(\s*{CATALOG}_errors_total\b[^)]*\)\s*>\s*0\b", e)
    ),
    # the staleness measured now from the newest completely scored as_of_date (the gauge
    # catalog_popularity_score_staleness_hours is the same age, frozen at the last run's end)
    "catalog: score staleness above 30 h": lambda a, e: _compares(
        e, f"{CATALOG}_scored_date_timestamp_seconds[7d])) / 3600", STALENESS_HOURS
    ),
    "news: no completed FullSweep for its period + 1 day": lambda a, e: _compares(
        e, f"{NEWS}_last_full_sweep_timestamp_seconds", 8 * 86400
    ),
    "catalog: backlog not draining for 2 days": _backlog(CATALOG),
    "both: deadline misses": _deadline_misses,
}


@pytest.mark.parametrize("spec", list(SPEC_ALERTS))
def test_spec_alert_exists(spec, alerts):
    matching = [a["alert"] for a in alerts if SPEC_ALERTS[spec](a, _norm(a["expr"]))]
    assert matching, f"no alert in {ALERTS.relative_to(REPO)} for: {spec}"


def test_deadline_alerts_cover_every_deadline_kind(alerts):
    assert DEADLINE_KINDS, "deadline_alerts() returned no alert"
    covered: set[str] = set()
    for a in alerts:
        e = _norm(a["expr"])
        if not _deadline_misses(a, e):
            continue
        kinds = set(re.findall(r'pin_nightly_deadline_missed_total\{[^}]*\balert="(\w+)"', e))
        covered |= kinds or DEADLINE_KINDS  # no alert= matcher: every kind
    assert covered >= DEADLINE_KINDS, f"deadline kinds without an alert: {DEADLINE_KINDS - covered}"


# ---------------------------------------------------------------------------- dashboard
def test_dashboard_uses_the_prometheus_datasource_variable(dashboard):
    variables = {v.get("name"): v for v in (dashboard.get("templating") or {}).get("list", [])}
    ds = variables.get("DS_PROMETHEUS")
    assert ds and ds.get("type") == "datasource" and ds.get("query") == "prometheus", ds
    problems = []
    ids = [p.get("id") for p in dashboard_panels(dashboard)]
    problems += [f"duplicate panel id {i}" for i in sorted(set(ids), key=str) if ids.count(i) > 1]
    for p in dashboard_panels(dashboard):
        if p.get("type") == "row":
            continue
        title = p.get("title")
        if not p.get("targets"):
            problems.append(f"panel {title!r}: no targets")
        if not {"x", "y", "w", "h"} <= set(p.get("gridPos") or {}):
            problems.append(f"panel {title!r}: no gridPos")
        for obj in (p, *p.get("targets", [])):
            uid = (obj.get("datasource") or {}).get("uid")
            if uid != "${DS_PROMETHEUS}":
                problems.append(f"panel {title!r}: datasource uid {uid!r}")
        for t in p.get("targets", []):
            if not str(t.get("expr", "")).strip():
                problems.append(f"panel {title!r} target {t.get('refId')}: no expr")
    assert not problems, "\n".join(problems)


def test_dashboard_queries_use_only_emitted_metrics_and_tags(dashboard, emitted):
    problems = []
    for title, t in dashboard_targets(dashboard):
        problems += check_references(
            f"panel {title!r} {t.get('refId')}", t.get("expr", ""), emitted
        )
    assert not problems, "\n".join(problems)


def test_dashboard_shows_every_emitted_metric(dashboard, emitted):
    series = exposed_series(emitted)
    shown = {
        series[m]
        for _, t in dashboard_targets(dashboard)
        for m in parse_promql(t.get("expr", "")).metrics
        if m in series
    }
    missing = set(emitted) - shown
    assert not missing, f"emitted but on no dashboard panel: {sorted(missing)}"


# ---------------------------------------------------------------------- promtool behaviour
def _promtool() -> str:
    import shutil

    exe = shutil.which("promtool")
    if exe is None:
        print(
            "\n[skip] promtool is not installed (Debian package prometheus; .ci/run installs "
            "it when CI=true)"
        )
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return exe


def test_promtool_checks_the_rules():
    import subprocess

    out = subprocess.run(
        [_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.long
def test_every_alert_fires_when_it_must_and_not_otherwise(alerts):
    """``promtool test rules alerts.test.yml alerts.days.test.yml`` as a person runs it, on
    the committed files: labels and rendered annotations of every firing alert; every alert has
    a case where it fires and one where it must not."""
    import subprocess

    exe = _promtool()
    files = ["alerts.test.yml", "alerts.days.test.yml"]
    out = subprocess.run(
        [exe, "test", "rules", *files], cwd=PROM_DIR, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cases = [
        t
        for name in files
        for group in yaml.safe_load((PROM_DIR / name).read_text())["tests"]
        for t in group["alert_rule_test"]
    ]
    firing = {t["alertname"] for t in cases if t.get("exp_alerts")}
    quiet = {t["alertname"] for t in cases if not t.get("exp_alerts")}
    names = {a["alert"] for a in alerts}
    assert names <= firing, f"alerts never tested firing: {names - firing}"
    assert names <= quiet, f"alerts never tested quiet: {names - quiet}"
