-- changefeed feed table, version 2: publish() and publish_many() in PL/pgSQL.
-- A LANGUAGE sql function of several statements is planned again on every call
-- in PostgreSQL 15; PL/pgSQL keeps its statements' plans for the session, which
-- takes most of publish()'s own cost off every writer's transaction.

CREATE OR REPLACE FUNCTION {schema}.publish(resource text, sub_resources text[], changed_resource_id text)
RETURNS void
LANGUAGE plpgsql
AS $fn$
BEGIN
    INSERT INTO {schema}.feed (resource, sub_resources, changed_resource_id)
    VALUES (publish.resource, coalesce(publish.sub_resources, '{}'), publish.changed_resource_id);
    PERFORM pg_notify({channel}, '');
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
    PERFORM pg_notify({channel}, '');
    RETURN appended;
END
$fn$;
