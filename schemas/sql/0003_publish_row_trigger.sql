-- changefeed feed table, version 3: publish_row(), a trigger function that
-- appends the feed entry of every row an API's own statement changes.
--
-- The entry is written by the API's own INSERT, UPDATE or DELETE, in its
-- transaction, with no statement of its own, and no write path can forget it.
-- Arguments: the resource, the column that holds the changed resource's id,
-- then the sub-resources that changed (none: the whole resource). Which rows
-- and columns count is up to the trigger's definition;
-- changefeed.publisher.install_trigger creates these (README, "Publishing"):
--
--   -- any change to a VM's row: the whole VM
--   CREATE TRIGGER changefeed_publish AFTER INSERT OR UPDATE OR DELETE ON vms
--   FOR EACH ROW EXECUTE FUNCTION {schema}.publish_row('vm', 'uuid');
--   -- a NIC row (its own table) of a VM: the VM's "nic" sub-resource
--   CREATE TRIGGER changefeed_publish AFTER INSERT OR UPDATE OR DELETE ON nics
--   FOR EACH ROW EXECUTE FUNCTION {schema}.publish_row('vm', 'vm_uuid', 'nic');
--   -- an UPDATE that sets the alias column: the VM's "alias" sub-resource
--   CREATE TRIGGER changefeed_alias AFTER UPDATE OF alias ON vms
--   FOR EACH ROW EXECUTE FUNCTION {schema}.publish_row('vm', 'uuid', 'alias');
--
-- An UPDATE that leaves the row as it was publishes nothing. Everything here
-- runs once per row of the API's write, so it does as little as it can.

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
    PERFORM pg_notify({channel}, '');
    RETURN NULL;
END
$fn$;
