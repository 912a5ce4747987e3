"""The Docker deployment (docker-compose.yaml, its CeleryExecutor override
docker-compose.celery.yaml, Dockerfile, .env.example), checked without a Docker engine: the files
are parsed (PyYAML) and compared with the repository, the installed Airflow's configuration
reference and each other; the override is also checked merged into docker-compose.yaml as
`docker compose -f docker-compose.yaml -f docker-compose.celery.yaml` merges it. No database is
needed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.parse
from importlib import metadata, util
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yaml"
CELERY_FILE = REPO / "docker-compose.celery.yaml"
DOCKERFILE = REPO / "Dockerfile"
ENV_EXAMPLE = REPO / ".env.example"
JOBS_DB_INIT = REPO / "include" / "compose" / "jobs-db-init.sh"

AIRFLOW_VERSION = "3.3.2"
AIRFLOW_SERVICES = {
    "airflow-apiserver",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-init",
}
REQUIRED_SERVICES = AIRFLOW_SERVICES | {"postgres", "jobs-db"}
MONITORING_SERVICES = {"statsd-exporter", "prometheus", "otel-collector", "jaeger"}
# Images without a shell or an HTTP client: no in-container healthcheck is possible; they are
# probed from outside (the collector's health_check extension on port 13133).
NO_SHELL_SERVICES = {"otel-collector"}
ONE_SHOT_SERVICES = {"airflow-init", "demo-data"}
AIRFLOW_MOUNTS = {
    "dags": "/opt/airflow/dags",
    "plugins": "/opt/airflow/plugins",
    "include": "/opt/airflow/include",
    "pools.json": "/opt/airflow/pools.json",
}
JOB_CONNECTIONS = ("news_db", "catalog_db")

# Compose interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR;
# "$$" is an escaped "$" (left to the container's shell).
INTERPOLATION = re.compile(
    r"(?<!\$)\$(?:\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|FERNET|TOKEN|API_KEY|PRIVATE_KEY", re.I)


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return parse_env_file(ENV_EXAMPLE.read_text())


def parse_env_file(text: str) -> dict[str, str]:
    values = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep, f".env.example: not NAME=value: {line!r}"
        values[name.strip()] = value.strip()
    return values


def environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict((item.split("=", 1) + [None])[:2] for item in env)
    return {k: (None if v is None else str(v)) for k, v in env.items()}


def scalars(node):
    """Every string value of a YAML tree (compose interpolates values, not keys)."""
    if isinstance(node, dict):
        for value in node.values():
            yield from scalars(value)
    elif isinstance(node, list):
        for value in node:
            yield from scalars(value)
    elif isinstance(node, str):
        yield node


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of ``text`` with ``env`` (as .env would give it)."""

    def one(m: re.Match) -> str:
        name = m["name"] or m["bare"]
        op, arg = m["op"], m["arg"] or ""
        value = env.get(name)
        if op in (":-", ":?") and not value or op in ("-", "?") and value is None:
            if op.endswith("?"):
                raise AssertionError(f"${{{name}}} is required: {arg}")
            return arg
        return value or ""

    return INTERPOLATION.sub(one, text).replace("$$", "$")


def script(service: dict) -> str:
    """A service's command as one shell text, line continuations joined."""
    command = service.get("command") or ""
    if isinstance(command, list):
        command = "\n".join(command)
    return re.sub(r"\\\n\s*", " ", command)


def cli_calls(text: str, prefix: str) -> list[list[str]]:
    """The argument lists of every ``prefix ...`` command line of a shell script."""
    calls = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(prefix + " "):
            calls.append(shlex.split(line.split(" #")[0])[len(prefix.split()) :])
    return calls


def options(args: list[str]) -> dict[str, str]:
    opts, rest = {}, iter(args)
    for arg in rest:
        if arg.startswith("--"):
            opts[arg] = next(rest, "")
    return opts


def volumes(service: dict) -> list[tuple[str, str, str]]:
    """(type, source, target) of each mount, short or long syntax."""
    result = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            result.append(
                (vol.get("type", "volume"), str(vol.get("source", "")), str(vol["target"]))
            )
            continue
        source, target = vol.split(":")[:2]
        kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        result.append((kind, source, target))
    return result


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def jobs_db_env(services, env_example) -> dict[str, str]:
    return {
        k: interpolate(v, env_example)
        for k, v in environment(services["jobs-db"]).items()
        if v is not None
    }


def init_connections(services, env_example) -> dict[str, dict[str, str]]:
    """conn_id -> options of the ``airflow connections add`` calls of airflow-init, with the
    shell variables resolved from the service's environment and .env.example."""
    init = services["airflow-init"]
    runtime_env = {
        k: interpolate(v, env_example) for k, v in environment(init).items() if v is not None
    }
    text = script(init).replace("$$", "$")
    conns = {}
    for args in cli_calls(text, "airflow connections add"):
        opts = options(args[1:])
        conns[args[0]] = {
            k: re.sub(r"\$\{(\w+)\}", lambda m: runtime_env.get(m[1], "<unset>"), v)
            for k, v in opts.items()
        }
    return conns


def published_ports(service: dict) -> list:
    return service.get("ports") or []


# --- services --------------------------------------------------------------------------------


def test_required_services_exist_and_start_by_default(services):
    missing = REQUIRED_SERVICES - set(services)
    assert not missing, f"services missing from docker-compose.yaml: {sorted(missing)}"
    for name in REQUIRED_SERVICES:
        assert not services[name].get("profiles"), (
            f"{name} is behind a profile: `docker compose up -d` would not start it"
        )
    for name in MONITORING_SERVICES:
        assert name in services, f"monitoring service {name} is missing"
        assert services[name].get("profiles") == ["monitoring"], (
            f"{name} must be in (only) the profile monitoring"
        )
    if "demo-data" in services:
        assert services["demo-data"].get("profiles"), "demo data must be loaded only on request"


def test_long_running_services_have_healthchecks(services):
    for name, svc in services.items():
        if name in ONE_SHOT_SERVICES:
            assert svc.get("restart") in (None, "no"), f"one-shot {name} must not be restarted"
            continue
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), (
            f"{name} is long-running but has no restart policy"
        )
        if name in NO_SHELL_SERVICES:
            assert not svc.get("healthcheck"), f"{name}: its image cannot run a healthcheck"
            continue
        check = svc.get("healthcheck") or {}
        assert (
            check.get("test")
            and not check.get("disable")
            and check["test"] not in (["NONE"], "NONE")
        ), f"{name} has no healthcheck"


def test_airflow_services_wait_for_metadata_db_and_init(services):
    for name in AIRFLOW_SERVICES:
        deps = services[name].get("depends_on") or {}
        assert deps.get("postgres", {}).get("condition") == "service_healthy", (
            f"{name} must wait for a healthy metadata database"
        )
        if name != "airflow-init":
            assert (
                deps.get("airflow-init", {}).get("condition") == "service_completed_successfully"
            ), f"{name} must start after airflow-init"
    # LocalExecutor: the tasks run in the scheduler and need the jobs' database.
    assert services["airflow-scheduler"]["depends_on"]["jobs-db"]["condition"] == "service_healthy"
    assert services["airflow-apiserver"].get("command") == "api-server"
    # ...and start through the execution API, whose first request the api-server's check makes
    deps = services["airflow-scheduler"]["depends_on"]
    assert deps["airflow-apiserver"]["condition"] == "service_healthy"
    assert "/execution/health" in " ".join(services["airflow-apiserver"]["healthcheck"]["test"])


# --- image -----------------------------------------------------------------------------------


def test_dockerfile_base_image_is_pinned():
    froms = [rest.split()[0] for keyword, rest in dockerfile_instructions() if keyword == "FROM"]
    assert len(froms) == 1, f"expected one FROM line, got {froms}"
    ref = froms[0]
    assert "$" not in ref, f"base image {ref} depends on a build argument"
    m = re.fullmatch(r"apache/airflow:(?:slim-)?(\d+\.\d+\.\d+)-python(\d+\.\d+)", ref)
    assert m, f"base image {ref} is not a pinned apache/airflow:<version>-python<x.y> tag"
    assert m[1] == AIRFLOW_VERSION
    # constraints.txt is frozen for one Python: the image must run that one.
    py = re.search(r"for Python (\d+\.\d+)", (REPO / "constraints.txt").read_text())
    assert py and m[2] == py[1], f"image Python {m[2]} but constraints.txt is for {py and py[1]}"


def test_versions_agree():
    pin = f"apache-airflow=={AIRFLOW_VERSION}"
    for name in ("requirements.txt", "constraints.txt"):
        lines = [line.strip() for line in (REPO / name).read_text().splitlines()]
        assert pin in lines, f"{name} does not pin {pin}"
    # The configuration reference the tests below read is the one of the deployed version.
    assert metadata.version("apache-airflow") == AIRFLOW_VERSION


def test_the_image_carries_no_development_tools():
    """The image installs requirements.txt: the runtime set, without the test and lint tools of
    requirements-dev.txt."""
    runtime = {
        re.split(r"[=<>\[ ]", line, maxsplit=1)[0].lower()
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    dev_only = {"pytest", "pgserver", "playwright", "ruff", "detect-secrets", "check-jsonschema"}
    assert runtime and not runtime & dev_only, runtime & dev_only
    assert "-r requirements.txt" in (REPO / "requirements-dev.txt").read_text()


def test_dockerfile_installs_pinned_requirements_as_airflow():
    instructions = dockerfile_instructions()
    user = "airflow"  # the base image's user
    installs = []
    for keyword, rest in instructions:
        if keyword == "USER":
            user = rest.split(":")[0]
        elif keyword == "RUN" and re.search(r"\bpip install\b", rest):
            installs.append((user, rest))
        elif keyword in ("COPY", "ADD"):
            sources = [a for a in shlex.split(rest) if not a.startswith("--")][:-1]
            assert {Path(s).name for s in sources} <= {"requirements.txt", "constraints.txt"}, (
                f"{keyword} {rest}: only the dependency files are baked in (the rest is mounted)"
            )
    assert installs, "the Dockerfile installs nothing"
    for user, command in installs:
        assert user == "airflow", "pip must run as the airflow user (official image docs)"
        assert re.search(r"(?:^|\s)-r\s+\S*requirements\.txt\b", command), command
        assert re.search(r"(?:^|\s)-c\s+\S*constraints\.txt\b", command), command


def test_no_pip_additional_requirements(services):
    for name, svc in services.items():
        assert "_PIP_ADDITIONAL_REQUIREMENTS" not in environment(svc), (
            f"{name}: dependencies belong in the image, not _PIP_ADDITIONAL_REQUIREMENTS"
        )
    for keyword, rest in dockerfile_instructions():
        assert "_PIP_ADDITIONAL_REQUIREMENTS" not in rest, f"Dockerfile {keyword} {rest}"


def test_airflow_services_share_the_built_image(compose, services):
    for name in AIRFLOW_SERVICES:
        svc = services[name]
        build = svc.get("build")
        context = build if isinstance(build, str) else (build or {}).get("context")
        assert context and (REPO / context).resolve() == REPO, f"{name} does not build ./"
        dockerfile = (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert (REPO / dockerfile).resolve() == DOCKERFILE
        assert svc.get("image") == services["airflow-scheduler"].get("image"), (
            f"{name} runs another image than the scheduler"
        )
    for name, svc in services.items():
        image = svc.get("image")
        if image and "build" not in svc:
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            assert tag and tag != "latest" and "$" not in image, f"{name}: unpinned {image}"


# --- Airflow configuration -------------------------------------------------------------------


def test_load_examples_off_and_core_settings(services):
    for name in AIRFLOW_SERVICES:
        env = environment(services[name])
        assert (env.get("AIRFLOW__CORE__LOAD_EXAMPLES") or "").lower() == "false", name
        assert env.get("AIRFLOW__CORE__EXECUTOR") == "LocalExecutor", name
        assert (
            env.get("AIRFLOW__CORE__EXECUTION_API_SERVER_URL")
            == "http://airflow-apiserver:8080/execution/"
        ), name
        assert env.get("AIRFLOW__CORE__DEFAULT_TASK_RETRIES") == "2", name
        assert (
            env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "").startswith("postgresql+psycopg2://")
            and "@postgres:" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        )
        # Components must agree on these or tokens / connection passwords cannot be read.
        for key in ("AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__API_AUTH__JWT_SECRET"):
            assert env.get(key) == environment(services["airflow-scheduler"]).get(key), (
                f"{name}: {key} differs from the scheduler's"
            )
            assert env.get(key), f"{name}: {key} is not set"


def known_options() -> set[tuple[str, str]]:
    """(section, option) of the installed Airflow's configuration reference and of every
    installed provider's (the celery provider's [celery] options, ...)."""
    spec = util.find_spec("airflow")
    reference = Path(list(spec.submodule_search_locations)[0]) / "config_templates" / "config.yml"
    sections = dict(yaml.safe_load(reference.read_text()))
    for ep in metadata.entry_points(group="apache_airflow_provider"):
        for section, body in (ep.load()().get("config") or {}).items():
            sections.setdefault(section, {"options": {}})
            sections[section]["options"] = {
                **(sections[section].get("options") or {}),
                **(body.get("options") or {}),
            }
    return {
        (section, option)
        for section, body in sections.items()
        for option in (body.get("options") or {})
    }


def assert_airflow_options_exist(services: dict[str, dict]) -> None:
    known = known_options()
    for name, svc in services.items():
        for key in environment(svc):
            if not key.startswith("AIRFLOW__"):
                continue
            _, section, option = key.lower().split("__", 2)
            option = (
                re.sub(r"_(cmd|secret)$", "", option) if (section, option) not in known else option
            )
            assert (section, option) in known, (
                f"{name}: {key} is no option of Airflow {AIRFLOW_VERSION} or its providers"
            )


def test_airflow_options_exist_in_airflow_config_reference(services):
    """Every AIRFLOW__SECTION__KEY is an option of the installed Airflow (catches typos, e.g.
    a misspelt metrics option that Airflow would silently ignore)."""
    assert_airflow_options_exist(services)


def test_metrics_go_to_statsd_exporter_with_tags(services, env_example):
    env = environment(services["airflow-scheduler"])
    assert env.get("AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED", "").lower() == "true", (
        "without InfluxDB-style tags statsd-exporter loses every metric tag"
    )
    host = env.get("AIRFLOW__METRICS__STATSD_HOST")
    assert host in services, f"StatsD host {host!r} is no compose service"
    listen = [
        a
        for a in scalars(services[host].get("command") or [])
        if a.startswith("--statsd.listen-udp=")
    ]
    assert listen and listen[0].rsplit(":", 1)[1] == env.get("AIRFLOW__METRICS__STATSD_PORT")
    assert "AIRFLOW__METRICS__STATSD_ON" in env
    # The mapping and the Prometheus files are those of include/monitoring/.
    mounts = {src: tgt for _, src, tgt in volumes(services[host])}
    assert mounts.get("./include/monitoring/statsd_mapping.yml")
    assert (
        f"--statsd.mapping-config={mounts['./include/monitoring/statsd_mapping.yml']}"
        in services[host]["command"]
    )
    prom = {src: tgt for _, src, tgt in volumes(services["prometheus"])}
    assert prom.get("./include/monitoring/prometheus") == "/etc/prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


def test_traces_go_through_the_collector_to_jaeger(services):
    env = environment(services["airflow-scheduler"])
    assert "AIRFLOW__TRACES__OTEL_ON" in env
    assert env.get("OTEL_TRACES_EXPORTER") == "otlp_proto_http"
    endpoint = urllib.parse.urlsplit(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"])
    assert endpoint.hostname == "otel-collector" and endpoint.path == "/v1/traces"
    mounts = {tgt: src for _, src, tgt in volumes(services["otel-collector"])}
    config_path = [
        a.split("=", 1)[1]
        for a in services["otel-collector"]["command"]
        if a.startswith("--config=")
    ][0]
    config = yaml.safe_load((REPO / mounts[config_path]).read_text())
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert http.rsplit(":", 1)[1] == str(endpoint.port)
    pipeline = config["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    exporters = [config["exporters"][name] for name in pipeline["exporters"]]
    assert any(e["endpoint"].split(":")[0] == "jaeger" for e in exporters)
    assert "health_check" in config["service"]["extensions"]


# --- mounts ----------------------------------------------------------------------------------


def test_bind_mount_sources_exist_in_repository(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        for kind, source, _target in volumes(svc):
            if kind != "bind":
                assert source in declared, f"{name}: volume {source} is not declared"
                continue
            assert "$" not in source, f"{name}: mount source {source} depends on a variable"
            path = (REPO / source).resolve()
            assert path.is_relative_to(REPO), f"{name}: {source} is outside the repository"
            assert path.exists(), f"{name}: mount source {source} does not exist"
    for name in AIRFLOW_SERVICES:
        mounts = {
            (REPO / src).resolve(): tgt
            for kind, src, tgt in volumes(services[name])
            if kind == "bind"
        }
        for source, target in AIRFLOW_MOUNTS.items():
            assert mounts.get(REPO / source) == target, f"{name}: ./{source} not at {target}"


def test_jobs_db_init_creates_the_connections_databases(services, env_example):
    jobs_db = services["jobs-db"]
    mounts = {src: tgt for kind, src, tgt in volumes(jobs_db) if kind == "bind"}
    init_target = mounts.get("./" + JOBS_DB_INIT.relative_to(REPO).as_posix())
    assert (
        init_target
        and init_target.startswith("/docker-entrypoint-initdb.d/")
        and init_target.endswith(".sh")
    ), "jobs-db does not run include/compose/jobs-db-init.sh"
    assert os.access(JOBS_DB_INIT, os.X_OK), "the init script must be executable (else sourced)"
    text = JOBS_DB_INIT.read_text()
    schema_dir = jobs_db_env(services, env_example).get("PIN_SCHEMA_DIR")
    assert schema_dir and mounts.get("./include/sql/schema") == schema_dir, (
        "the schema files are not mounted where the init script reads them"
    )

    created = set(re.search(r"^for db in ([\w ]+); do$", text, re.M)[1].split())
    assert "CREATE DATABASE" in text
    applied: dict[str, list[str]] = {}
    for db, sql in re.findall(r'--dbname (\w+) -f "\$\{SCHEMA_DIR\}/([\w.]+)"', text):
        assert (REPO / "include" / "sql" / "schema" / sql).is_file(), f"missing schema/{sql}"
        assert db in created, f"{sql} is applied to {db}, which the script does not create"
        applied.setdefault(db, []).append(sql)

    conns = init_connections(services, env_example)
    domain = {"news_db": "news_domain.sql", "catalog_db": "catalog_domain.sql"}
    for conn_id in JOB_CONNECTIONS:
        db = conns[conn_id]["--conn-schema"]
        assert db in created, f"{conn_id} points to database {db}, never created"
        assert domain[conn_id] in applied.get(db, []), f"{db} lacks {domain[conn_id]}"


# --- airflow-init ----------------------------------------------------------------------------


def test_init_imports_pools_json(services):
    init = services["airflow-init"]
    imports = [args for args in cli_calls(script(init), "airflow pools") if args[0] == "import"]
    assert imports, "airflow-init does not import the pools"
    mounts = {tgt: (REPO / src).resolve() for kind, src, tgt in volumes(init) if kind == "bind"}
    for args in imports:
        assert mounts.get(args[1]) == REPO / "pools.json", (
            f"airflow-init imports {args[1]}, which is not the repository's pools.json"
        )


def test_every_pool_is_defined_in_pools_json():
    from airflow.dag_processing.dagbag import DagBag

    pools = json.loads((REPO / "pools.json").read_text())
    bag = DagBag(dag_folder=str(REPO / "dags"))
    used = {t.pool for dag in bag.dags.values() for t in dag.tasks} - {"default_pool"}
    assert used, "no pool found in the DAG files"
    assert used <= set(pools), f"pools used by the DAGs but not imported: {used - set(pools)}"
    for name, pool in pools.items():
        assert isinstance(pool.get("slots"), int) and pool["slots"] >= 1, name


def test_init_creates_job_connections(services, env_example):
    conns = init_connections(services, env_example)
    db_env = jobs_db_env(services, env_example)
    for conn_id in JOB_CONNECTIONS:
        assert conn_id in conns, f"airflow-init does not create connection {conn_id}"
        conn = conns[conn_id]
        assert conn.get("--conn-type") == "postgres", conn_id
        assert conn.get("--conn-host") in services, f"{conn_id}: host is no compose service"
        assert conn.get("--conn-port") == "5432"
        # The credentials are those jobs-db is created with.
        assert conn.get("--conn-login") == db_env["POSTGRES_USER"], conn_id
        assert conn.get("--conn-password") == db_env["POSTGRES_PASSWORD"], conn_id
    assert conns["news_db"]["--conn-schema"] == "news"
    assert conns["catalog_db"]["--conn-schema"] == "catalog"


# --- secrets and variables -------------------------------------------------------------------


def _no_literal_default(m: re.Match) -> bool:
    return not (m["op"] or "").endswith("-") or not m["arg"]


def _only_interpolation(value: str) -> bool:
    """True when ``value`` is made of interpolations without a literal default."""
    parts = list(INTERPOLATION.finditer(value))
    rest = INTERPOLATION.sub("", value)
    return bool(parts) and not rest.strip() and all(map(_no_literal_default, parts))


def _url_passwords(value: str) -> list[str]:
    """The password part of every ``scheme://user:password@host`` in ``value``, with its
    interpolations (which may hold ':' or spaces) put back."""
    found: list[str] = []

    def mask(m: re.Match) -> str:
        found.append(m[0])
        return f"VAR{len(found) - 1}X"

    masked = INTERPOLATION.sub(mask, value)
    return [
        re.sub(r"VAR(\d+)X", lambda v: found[int(v[1])], m[1])
        for m in re.finditer(r"://[^/\s:@]+:([^@\s]+)@", masked)
    ]


def assert_no_literal_secrets(compose: dict, services: dict[str, dict]) -> None:
    for name, svc in services.items():
        for key, value in environment(svc).items():
            if SECRET_NAME.search(key) and not key.endswith(("_FILE", "_PATH", "_CONN_ID")):
                assert value is not None and _only_interpolation(value), (
                    f"{name}: {key} must come from .env (${{VAR:?}}), got {value!r}"
                )
    for value in scalars(compose):
        for password in _url_passwords(value):
            assert _only_interpolation(password), f"literal password in URL {value!r}"
        for m in re.finditer(r"--[\w-]*password[= ]\s*\"?([^\s\"]+)", value, re.I):
            assert m[1].startswith("$"), f"literal password on a command line: {m[0]!r}"


def test_no_literal_secrets(compose, services):
    assert_no_literal_secrets(compose, services)


def test_env_example_holds_placeholders_only(env_example):
    for name, value in env_example.items():
        if SECRET_NAME.search(name):
            assert "change-me" in value, f".env.example: {name} must be a change-me placeholder"


def test_interpolated_variables_are_in_env_example(compose, services, env_example):
    referenced: dict[str, set[str]] = {}
    for value in scalars(compose):
        for m in INTERPOLATION.finditer(value):
            referenced.setdefault(m["name"] or m["bare"], set()).add(m["op"] or "")
    undefined = set(referenced) - set(env_example)
    assert not undefined, f"used in docker-compose.yaml, missing in .env.example: {undefined}"
    for name, ops in referenced.items():
        if any(op.endswith("?") for op in ops):
            assert env_example[name], f".env.example: required {name} is empty"
    unused = set(env_example) - set(referenced)
    assert not unused, f".env.example defines variables docker-compose.yaml never uses: {unused}"
    # Pass-through variables (no value in compose) are documented there, commented out.
    env_text = ENV_EXAMPLE.read_text()
    for name, svc in services.items():
        for key, value in environment(svc).items():
            if value is None:
                assert re.search(rf"^#?\s*{key}=", env_text, re.M), (
                    f"{name}: pass-through {key} is not documented in .env.example"
                )
    # .env.example as .env satisfies every required variable.
    for value in scalars(compose):
        interpolate(value, env_example)


# --- network ---------------------------------------------------------------------------------


def assert_ports_bind_localhost(services: dict[str, dict], env_example: dict[str, str]) -> None:
    for name, svc in services.items():
        for port in published_ports(svc):
            if isinstance(port, dict):
                host_ip = port.get("host_ip")
            else:
                parts = interpolate(str(port), env_example).split(":")
                host_ip = parts[0] if len(parts) == 3 else None
            assert host_ip == "127.0.0.1", f"{name}: port {port} is published on every interface"


def test_published_ports_bind_localhost(services, env_example):
    assert_ports_bind_localhost(services, env_example)
    api_ports = [str(p) for p in published_ports(services["airflow-apiserver"])]
    assert any(p.startswith("127.0.0.1:") and p.endswith(":8080") for p in api_ports), (
        "the api-server's port 8080 is not published on 127.0.0.1"
    )


def check_compose_spec(path: Path) -> None:
    tool = Path(sys.executable).with_name("check-jsonschema")
    proc = subprocess.run(
        [str(tool), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_file_matches_the_compose_spec():
    """docker-compose.yaml against the Compose Specification's JSON schema (vendored by
    check-jsonschema); the tests above check what only this project knows."""
    check_compose_spec(COMPOSE_FILE)


# --- CeleryExecutor: docker-compose.celery.yaml ----------------------------------------------

CELERY_SERVICES = {"redis", "airflow-worker", "flower"}
CELERY_AIRFLOW_SERVICES = AIRFLOW_SERVICES | {"airflow-worker", "flower"}
# sequences that an override or an extending service replaces instead of extending
REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def merge(base, override, key: str | None = None):
    """Compose's merge of ``override`` into ``base`` (the rules these files rely on): mappings
    merge key by key, commands and healthcheck tests are replaced, volumes merge by target,
    other sequences are appended without duplicates, scalars are replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else v
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in REPLACED_SEQUENCES:
        if key == "volumes":
            targets = {t for _, _, t in volumes({"volumes": override})}
            kept = [v for v, (_, _, t) in zip(base, volumes({"volumes": base})) if t not in targets]
            return kept + override
        return base + [v for v in override if v not in base]
    return override


def resolve_extends(service: dict) -> dict:
    """A service with ``extends``: the referenced service, then this one merged over it.
    ``depends_on`` is not inherited (Compose's documented rule): it must be declared here."""
    ext = service.get("extends")
    if not ext:
        return service
    base = yaml.safe_load((REPO / ext["file"]).read_text())["services"][ext["service"]]
    base = {k: v for k, v in resolve_extends(base).items() if k != "depends_on"}
    return merge(base, {k: v for k, v in service.items() if k != "extends"})


@pytest.fixture(scope="module")
def celery_compose() -> dict:
    return yaml.safe_load(CELERY_FILE.read_text())


@pytest.fixture(scope="module")
def celery_services(compose, celery_compose) -> dict[str, dict]:
    """The services of `docker compose -f docker-compose.yaml -f docker-compose.celery.yaml`."""
    merged = {name: resolve_extends(svc) for name, svc in compose["services"].items()}
    for name, svc in celery_compose["services"].items():
        merged[name] = merge(merged[name], svc) if name in merged else resolve_extends(svc)
    return merged


def test_celery_file_and_the_merged_project_match_the_compose_spec(
    compose, celery_services, tmp_path
):
    check_compose_spec(CELERY_FILE)
    merged = tmp_path / "docker-compose.merged.yaml"
    merged.write_text(yaml.safe_dump({**compose, "services": celery_services}))
    check_compose_spec(merged)


def test_celery_services_exist_with_healthchecks(celery_compose, celery_services):
    assert CELERY_SERVICES <= set(celery_compose["services"])
    for name in ("redis", "airflow-worker"):
        assert not celery_services[name].get("profiles"), f"{name} must start by default"
    assert celery_services["flower"].get("profiles") == ["flower"], "flower only on request"
    for name in CELERY_SERVICES:
        svc = celery_services[name]
        assert svc.get("restart") in ("always", "unless-stopped", "on-failure"), name
        check = svc.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
    assert "redis-cli" in celery_services["redis"]["healthcheck"]["test"]
    assert "--save" in celery_services["redis"]["command"]
    # each worker answers for itself: Celery's default node name is celery@<container hostname>
    ping = " ".join(celery_services["airflow-worker"]["healthcheck"]["test"])
    assert re.search(r"inspect ping -d \"celery@\$\$\{HOSTNAME\}\"", ping), ping
    assert "airflow.providers.celery.executors.celery_executor.app" in ping
    # the broker is not published on the host
    assert not published_ports(celery_services["redis"])


def test_celery_workers_run_the_stack_image_with_its_mounts(celery_services):
    worker, scheduler = celery_services["airflow-worker"], celery_services["airflow-scheduler"]
    assert worker["command"] == "celery worker"
    assert celery_services["flower"]["command"] == "celery flower"
    for name in ("airflow-worker", "flower"):
        svc = celery_services[name]
        for key in ("image", "build", "user"):
            assert svc.get(key) == scheduler.get(key), f"{name}: {key} differs from the scheduler"
    mounts = {(REPO / src).resolve(): tgt for kind, src, tgt in volumes(worker) if kind == "bind"}
    for source, target in AIRFLOW_MOUNTS.items():
        assert mounts.get(REPO / source) == target, f"airflow-worker: ./{source} not at {target}"
    assert (worker.get("deploy") or {}).get("replicas", 1) >= 2, "fewer than two workers"
    assert int(environment(worker)["AIRFLOW__CELERY__WORKER_CONCURRENCY"]) >= 1


def test_every_airflow_component_uses_the_celery_executor(celery_services, env_example):
    redis = celery_services["redis"]
    scheduler_env = environment(celery_services["airflow-scheduler"])
    for name in CELERY_AIRFLOW_SERVICES:
        env = environment(celery_services[name])
        assert env.get("AIRFLOW__CORE__EXECUTOR") == "CeleryExecutor", name
        broker = urllib.parse.urlsplit(interpolate(env["AIRFLOW__CELERY__BROKER_URL"], {}))
        assert broker.scheme == "redis" and broker.hostname == "redis", name
        assert str(broker.port or 6379) in map(str, redis.get("expose") or []), name
        # the result backend is the metadata database, with the same credentials
        assert (
            env["AIRFLOW__CELERY__RESULT_BACKEND"]
            == "db+" + env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        ), name
        interpolate(env["AIRFLOW__CELERY__RESULT_BACKEND"], env_example)
        # the scheduler's whole environment (secrets, metrics, traces, pin-nightly settings):
        # a task runs in a worker as it ran in the LocalExecutor's scheduler
        for key, value in scheduler_env.items():
            assert env.get(key, "<unset>") == value, f"{name}: {key} differs from the scheduler"
    # a message not acknowledged in the visibility timeout is delivered again: it must outlast
    # the longest lease (a run never works longer than its lease's TTL)
    from pin_nightly import catalog, news

    timeout = int(scheduler_env["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"])
    longest = max(m.DEFAULTS["lock_ttl_minutes"] for m in (news, catalog)) * 60
    assert timeout > longest


def test_celery_dependencies(celery_services):
    for name in CELERY_AIRFLOW_SERVICES:
        deps = celery_services[name].get("depends_on") or {}
        assert deps.get("redis", {}).get("condition") == "service_healthy", (
            f"{name} must wait for a healthy broker"
        )
        assert deps.get("postgres", {}).get("condition") == "service_healthy", name
        if name != "airflow-init":
            assert (
                deps.get("airflow-init", {}).get("condition") == "service_completed_successfully"
            ), f"{name} must start after airflow-init"
    worker = celery_services["airflow-worker"]["depends_on"]
    # the tasks run in the workers: they need the jobs' database and the execution API
    assert worker["jobs-db"]["condition"] == "service_healthy"
    assert worker["airflow-apiserver"]["condition"] == "service_healthy"


def test_celery_file_holds_no_secrets_and_publishes_on_localhost(
    celery_compose, celery_services, env_example
):
    assert_no_literal_secrets(celery_compose, celery_services)
    assert_ports_bind_localhost(celery_services, env_example)
    assert_airflow_options_exist(celery_services)
    referenced = {
        m["name"] or m["bare"]
        for value in scalars(celery_compose)
        for m in INTERPOLATION.finditer(value)
    }
    missing = referenced - set(env_example)
    assert not missing, f"used in docker-compose.celery.yaml, missing in .env.example: {missing}"
    for value in scalars(celery_compose):
        interpolate(value, env_example)


# --- Kubernetes, on paper: deploy/kubernetes/ ------------------------------------------------
# Structure only: no cluster, no Helm here.

K8S = REPO / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def k8s_values() -> dict:
    return yaml.safe_load((K8S / "values.yaml").read_text())


@pytest.fixture(scope="module")
def k8s_pod() -> dict:
    return yaml.safe_load((K8S / "pod-template.yaml").read_text())


def k8s_dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (K8S / "Dockerfile").read_text())
    return [
        (line.partition(" ")[0].upper(), line.partition(" ")[2].strip())
        for line in map(str.strip, text.splitlines())
        if line and not line.startswith("#")
    ]


def test_k8s_values_use_the_kubernetes_executor_and_the_project_image(k8s_values, services):
    assert k8s_values["executor"] == "KubernetesExecutor"
    assert k8s_values["airflowVersion"] == AIRFLOW_VERSION
    image = k8s_values["images"]["airflow"]
    compose_repo, _, compose_tag = services["airflow-scheduler"]["image"].rpartition(":")
    # the compose image's repository, with the code baked in on top of its tag
    assert image["repository"] == compose_repo
    assert image["tag"].startswith(compose_tag + "-") and image["tag"] != "latest"
    assert k8s_values["dags"]["gitSync"]["enabled"] is False, "the DAG files are in the image"
    assert k8s_values["postgresql"]["enabled"] is False
    assert k8s_values["triggerer"]["enabled"] is True, "the deadline alerts need the triggerer"
    assert k8s_values["config"]["core"]["load_examples"] == "False"
    known = known_options()
    sections = {s for s, _ in known}
    for section, options in k8s_values["config"].items():
        for option in options if section in sections else ():
            assert (section, option) in known, f"config.{section}.{option} is no Airflow option"


def test_k8s_secrets_come_from_kubernetes_secrets(k8s_values):
    for key in ("fernetKey", "jwtSecret", "apiSecretKey", "webserverSecretKey"):
        assert key not in k8s_values, f"{key} inline: use {key}SecretName"
    for key in ("fernetKeySecretName", "jwtSecretName", "apiSecretKeySecretName"):
        assert k8s_values.get(key), f"{key} is not set"
    assert k8s_values["data"].get("metadataSecretName")
    assert "metadataConnection" not in k8s_values["data"]
    assert "pin-nightly-connections" in k8s_values["extraEnvFrom"]
    for value in scalars(k8s_values):
        assert not _url_passwords(value), f"a password in values.yaml: {value!r}"


def test_k8s_pod_template_runs_the_image_with_the_jobs_settings(k8s_values, k8s_pod):
    assert k8s_pod["kind"] == "Pod" and k8s_pod["spec"]["restartPolicy"] == "Never"
    (base,) = [c for c in k8s_pod["spec"]["containers"] if c["name"] == "base"]
    image = k8s_values["images"]["airflow"]
    assert base["image"] == f"{image['repository']}:{image['tag']}"
    env = {e["name"]: e.get("value") for e in base["env"]}
    values_env = {e["name"]: e["value"] for e in k8s_values["env"]}
    for key in ("PIN_SQL_DIR", "PIN_ALERT_CONN_ID"):
        assert env[key] == values_env[key], key
    secrets = [s["secretRef"]["name"] for s in base["envFrom"]]
    assert secrets == ["pin-nightly-connections"]
    # a graceful stop (SIGTERM) lets the batch in flight end
    assert k8s_pod["spec"]["terminationGracePeriodSeconds"] >= 30


def test_k8s_image_bakes_in_what_compose_mounts(services, k8s_values):
    instructions = k8s_dockerfile()
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert froms == [services["airflow-scheduler"]["image"]], "built on the compose image"
    copied = {}
    for keyword, rest in instructions:
        if keyword == "COPY":
            *sources, target = [a for a in shlex.split(rest) if not a.startswith("--")]
            copied.update({s.rstrip("/"): target.rstrip("/") for s in sources})
    assert copied == AIRFLOW_MOUNTS, "the image holds what docker-compose.yaml mounts, there"
    env = dict(a.split("=", 1) for k, rest in instructions if k == "ENV" for a in rest.split())
    assert env["PIN_SQL_DIR"] == AIRFLOW_MOUNTS["include"] + "/sql"
    assert env["PIN_SQL_DIR"] == {e["name"]: e["value"] for e in k8s_values["env"]}["PIN_SQL_DIR"]
    assert (REPO / "include" / "sql").is_dir()
