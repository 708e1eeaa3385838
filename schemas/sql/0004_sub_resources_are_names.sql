-- changefeed feed table, version 4: every sub-resource is a non-empty string.
-- publish('vm', ARRAY[NULL], ...) used to store {NULL}, which reached listeners
-- as "subResources": [null] (the wire contract says strings) and matched no
-- listener that names its sub-resources; '' matched none either. Both are a
-- writer's bug, now refused in the writer's own transaction, whichever way the
-- entry comes in (publish, publish_many, publish_row, a plain INSERT). A NULL
-- array still means the resource as a whole, as '{}' does.
-- NOT VALID: adding it does not scan (and lock) a feed in service; entries
-- already there are not checked, and age out.
ALTER TABLE {schema}.feed
    ADD CONSTRAINT feed_sub_resources_are_names
    CHECK (array_position(sub_resources, NULL) IS NULL AND '' <> ALL (sub_resources))
    NOT VALID;
