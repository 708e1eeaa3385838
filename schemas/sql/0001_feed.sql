-- changefeed feed table, version 1.
-- {schema} is replaced by the configured schema name, validated and quoted by
-- changefeed.schemas.migrations (it comes from configuration, never from a request).

CREATE TABLE {schema}.feed (
    -- Feed order is (txid, id). id alone is assigned at INSERT time, not at
    -- commit, so a reader of "id > last" skips entries of transactions that
    -- commit late. txid is the writer's transaction id: every entry of a
    -- transaction below the snapshot horizon (pg_snapshot_xmin) is final, so
    -- the tailer reads (txid, id) > cursor AND txid < horizon and never skips.
    id                  bigint GENERATED ALWAYS AS IDENTITY,
    txid                xid8 NOT NULL DEFAULT pg_current_xact_id(),
    resource            text NOT NULL CHECK (resource <> ''),
    sub_resources       text[] NOT NULL DEFAULT '{}',
    changed_resource_id text NOT NULL CHECK (changed_resource_id <> ''),
    published           timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (txid, id)
) WITH (fillfactor = 100, autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);

-- Retention deletes by age.
CREATE INDEX feed_published_idx ON {schema}.feed (published);

-- One row: the oldest resumable position. A cursor at or after it can resume
-- (everything after it is still held); an older one must re-bootstrap.
-- Whoever deletes entries (inline retention, the Spark job) raises it in the
-- same transaction as the delete.
CREATE TABLE {schema}.feed_state (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    low_water_txid  xid8 NOT NULL DEFAULT '0',
    low_water_id    bigint NOT NULL DEFAULT 0,
    updated         timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.feed_state DEFAULT VALUES;

-- Call inside the writer's own transaction, from any language:
--   SELECT {schema}.publish('vm', ARRAY['nic'], '<uuid>');
-- The NOTIFY is only a doorbell for the tailers (empty payload); PostgreSQL
-- folds identical notifications of one transaction into one, and delivers
-- them only at commit, so a rolled-back change rings nothing.
CREATE FUNCTION {schema}.publish(resource text, sub_resources text[], changed_resource_id text)
RETURNS void
LANGUAGE sql
AS $fn$
    INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
    VALUES (resource, coalesce(sub_resources, '{}'), changed_resource_id);
    SELECT pg_notify({channel}, '');
$fn$;

-- Batch form for bulk writers: one round trip, one doorbell.
-- sub_resources are given as one comma-joined string per entry ('' = none).
CREATE FUNCTION {schema}.publish_many(resources text[], sub_resources text[], changed_resource_ids text[])
RETURNS bigint
LANGUAGE sql
AS $fn$
    SELECT pg_notify({channel}, '');
    WITH ins AS (
        INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
        SELECT r, CASE WHEN coalesce(s, '') = '' THEN '{}'::text[] ELSE string_to_array(s, ',') END, i
        FROM unnest(resources, sub_resources, changed_resource_ids) AS u(r, s, i)
        RETURNING 1
    )
    SELECT count(*) FROM ins;
$fn$;
