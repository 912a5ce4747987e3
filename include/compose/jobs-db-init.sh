#!/usr/bin/env bash
# jobs-db first start (docker-compose.yaml mounts this file into /docker-entrypoint-initdb.d/;
# the postgres image runs it once, on an empty data volume, as POSTGRES_USER over the local
# socket). Creates the two domain databases the jobs work on, with the domain tables as the news
# and catalog services own them in production:
#   news     news_domain.sql + news_recommended_indexes.sql   (Airflow connection news_db)
#   catalog  catalog_domain.sql                               (Airflow connection catalog_db)
# Job-owned objects (schema pin_nightly, catalog.popularity_daily_views) are created by the DAGs.
# To run it again: docker compose down -v (drops the jobs-db volume) and start again.
# No `set -u` and no `exit`: the postgres entrypoint sources this file if it is not executable.
set -eo pipefail

SCHEMA_DIR="${PIN_SCHEMA_DIR:-/pin-nightly/sql/schema}"

run_psql() {
    psql -v ON_ERROR_STOP=1 --no-psqlrc --username "${POSTGRES_USER}" "$@"
}

for db in news catalog; do
    echo "pin-nightly: database ${db}"
    run_psql --dbname postgres --set=db="${db}" <<'SQL'
SELECT format('CREATE DATABASE %I', :'db')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db')
\gexec
SQL
done

# psql -f runs each statement on its own (autocommit), as CREATE INDEX CONCURRENTLY needs.
run_psql --dbname news -f "${SCHEMA_DIR}/news_domain.sql"
run_psql --dbname news -f "${SCHEMA_DIR}/news_recommended_indexes.sql"
run_psql --dbname catalog -f "${SCHEMA_DIR}/catalog_domain.sql"
echo "pin-nightly: domain tables of news and catalog are ready"
