#!/bin/sh
# Run once by the postgres image when it makes the primary's data directory
# (/docker-entrypoint-initdb.d): changefeed's server settings, and a role that
# standbys copy and stream from.
set -eu
echo "include '/etc/postgresql/changefeed.conf'" >> "$PGDATA/postgresql.conf"
psql -v ON_ERROR_STOP=1 -U postgres -d postgres -v pw="$CHANGEFEED_REPLICATION_PASSWORD" <<'SQL'
CREATE ROLE replicator WITH REPLICATION LOGIN PASSWORD :'pw';
SQL
echo "host replication replicator all scram-sha-256" >> "$PGDATA/pg_hba.conf"
