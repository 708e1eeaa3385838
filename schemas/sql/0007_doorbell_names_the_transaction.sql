-- changefeed feed table, version 7: the doorbell names the writer's transaction.
-- A publisher that reads a hot standby hears the doorbell on the primary (a
-- standby refuses LISTEN), possibly before the standby has replayed the
-- commit. The payload, the writer's transaction id, tells it what to wait
-- for: it reads the standby until its snapshot horizon has passed that
-- transaction (docs/design.md, "Reading from a standby"). Publishers on the
-- primary ignore the payload. One transaction still rings once: its
-- notifications are identical, and PostgreSQL folds them into one.

CREATE OR REPLACE FUNCTION {schema}.publish(resource text, sub_resources text[], changed_resource_id text)
RETURNS void
LANGUAGE plpgsql
AS $fn$
BEGIN
    INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
    VALUES (publish.resource, coalesce(publish.sub_resources, '{}'), publish.changed_resource_id);
    PERFORM pg_notify({channel}, pg_current_xact_id()::text);
END
$fn$;

CREATE OR REPLACE FUNCTION {schema}.publish_many(resources text[], sub_resources text[], changed_resource_ids text[])
RETURNS bigint
LANGUAGE plpgsql
AS $fn$
DECLARE
    appended bigint;
BEGIN
    INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
    SELECT r, CASE WHEN coalesce(s, '') = '' THEN '{}'::text[] ELSE string_to_array(s, ',') END, i
    FROM unnest(publish_many.resources, publish_many.sub_resources, publish_many.changed_resource_ids)
        AS u(r, s, i);
    GET DIAGNOSTICS appended = ROW_COUNT;
    IF appended > 0 THEN
        PERFORM pg_notify({channel}, pg_current_xact_id()::text);
    END IF;
    RETURN appended;
END
$fn$;

CREATE OR REPLACE FUNCTION {schema}.publish_row()
RETURNS trigger
LANGUAGE plpgsql
AS $fn$
DECLARE
    changed_id text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        changed_id := to_jsonb(OLD) ->> TG_ARGV[1];
    ELSIF TG_OP = 'UPDATE' AND NEW IS NOT DISTINCT FROM OLD THEN
        RETURN NULL;
    ELSE
        changed_id := to_jsonb(NEW) ->> TG_ARGV[1];
    END IF;
    IF changed_id IS NULL OR changed_id = '' THEN
        RAISE EXCEPTION 'changefeed: trigger % on %: no id in column %',
            TG_NAME, TG_TABLE_NAME, quote_ident(coalesce(TG_ARGV[1], '(none given)'))
            USING HINT = 'publish_row(resource, id_column, [sub_resource, ...])';
    END IF;
    INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
    VALUES (TG_ARGV[0], coalesce(TG_ARGV[2:], '{}'), changed_id);
    PERFORM pg_notify({channel}, pg_current_xact_id()::text);
    RETURN NULL;
END
$fn$;
