"""The job package's Airflow plugin: what it adds to Airflow's own components (the package's
code is ``plugins/pin_nightly``, which Airflow does not load as plugins: see .airflowignore)."""

from airflow.plugins_manager import AirflowPlugin

from pin_nightly import notes


class PinNightlyPlugin(AirflowPlugin):
    name = "pin_nightly"
    listeners = [notes]  # the DAG run's note: its outcome in one line
