"""The pin-nightly console in the Airflow UI: a read-only page of both jobs' state.

The API server mounts the console's FastAPI app at ``/pin-nightly`` and the UI lists it in its
navigation (Browse); the code is ``pin_nightly.console``, the page is described in
docs/operations.md, "The console".
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from pin_nightly import console


class PinNightlyConsole(AirflowPlugin):
    name = "pin_nightly_console"
    fastapi_apps = [
        {"app": console.create_app(), "url_prefix": console.URL_PREFIX, "name": "pin-nightly"}
    ]
    external_views = [
        {
            "name": "pin-nightly",
            "href": console.URL_PREFIX + "/",
            "destination": "nav",
            "category": "browse",
            "url_route": "pin-nightly",
        }
    ]
