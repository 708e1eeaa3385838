#!/bin/sh
# The standby's entrypoint: on first start, copy the primary with pg_basebackup -R
# (standby.signal, primary_conninfo, a replication slot so that the primary keeps
# the WAL this standby still needs); then run PostgreSQL as a hot standby with
# deploy/postgresql/standby.conf.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    chmod 700 "$PGDATA"
    PGPASSWORD="$CHANGEFEED_REPLICATION_PASSWORD" pg_basebackup \
        --host=primary --username=replicator --pgdata="$PGDATA" \
        --write-recovery-conf --wal-method=stream --checkpoint=fast \
        --create-slot --slot="$STANDBY_SLOT"
    echo "include '/etc/postgresql/standby.conf'" >> "$PGDATA/postgresql.conf"
fi
exec postgres
