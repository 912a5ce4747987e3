# pin-nightly Airflow image: the official Airflow 3.3.2 image (Python 3.11, the Python that
# constraints.txt was frozen for) plus this project's pinned dependencies.
#
#   docker compose build          (docker-compose.yaml builds and tags it)
#
# Dependencies are baked into the image as the official image docs recommend
# (https://airflow.apache.org/docs/docker-stack/build.html), never installed at container
# start. Only the two dependency files are copied: dags/, plugins/ and include/ are mounted
# by docker-compose.yaml (bake them in with COPY for a deployment without bind mounts).
# requirements.txt is the runtime set only (development tools are in requirements-dev.txt).
FROM apache/airflow:3.3.2-python3.11

USER airflow
COPY --chown=airflow:0 requirements.txt constraints.txt /opt/pin-nightly/
RUN pip install --no-cache-dir -r /opt/pin-nightly/requirements.txt \
        -c /opt/pin-nightly/constraints.txt \
    && python -c "from importlib.metadata import version as v; assert v('apache-airflow') == '3.3.2'"
