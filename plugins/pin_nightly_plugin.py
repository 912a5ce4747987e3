"""The job package's Airflow plugin: what it adds to Airflow's own components (the package's
code is ``plugins/pin_nightly``, which Airflow does not load as plugins: see .airflowignore).

- the console: the API server mounts its FastAPI app at ``/pin-nightly`` and the UI lists it in
  its navigation (Browse); ``pin_nightly.console``, described in docs/operations.md, "The
  console";
- the DAG run's note, the run's outcome in one line: a listener the scheduler calls when a run
  ends (``pin_nightly.notes``).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from pin_nightly import console, notes


class PinNightlyPlugin(AirflowPlugin):
    name = "pin_nightly"
    listeners = [notes]
    fastapi_apps = [{"app": console.App(), "url_prefix": console.URL_PREFIX, "name": "pin-nightly"}]
    external_views = [
        {
            "name": "pin-nightly",
            "href": console.URL_PREFIX + "/",
            "destination": "nav",
            "category": "browse",
            "url_route": "pin-nightly",
        }
    ]
