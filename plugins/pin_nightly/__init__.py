"""pin-nightly: nightly PostgreSQL maintenance jobs run as Airflow DAGs.

The package holds all job logic; the DAG files in ``dags/`` only wire tasks to it. Importing it
has no side effects (no database or Variable access).
"""

__version__ = "0.1.0"
