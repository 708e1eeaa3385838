-- Least-privilege roles for the feed of schema "changefeed". Run as the schema
-- owner (the role `changefeed db init` ran as) after `changefeed db init`:
--     psql "$OWNER_DSN" -f deploy/postgresql/roles.sql
-- Re-running is harmless. Set passwords out of band (psql's \password, or your
-- secret store); none is written here.
--
--   changefeed_publisher  `changefeed serve`: tails the feed, trims it (inline
--                         retention), reads pg_stat_activity for the oldest
--                         open transaction. It cannot write entries or DDL.
--   changefeed_writer     granted to each API role that publishes: may append
--                         entries with changefeed.publish()/publish_many(),
--                         or attach changefeed.publish_row() triggers to its
--                         own tables, and nothing else in the schema.
-- APIs that embed a publisher (the example VM API) need both.
-- The Spark job (deploy/spark/) needs its own grants: see there.

DO $$
BEGIN
    CREATE ROLE changefeed_publisher LOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END
$$;

DO $$
BEGIN
    CREATE ROLE changefeed_writer NOLOGIN;
EXCEPTION WHEN duplicate_object THEN
    NULL;
END
$$;

GRANT USAGE ON SCHEMA changefeed TO changefeed_publisher, changefeed_writer;

-- Tail, resume (read), retention (delete old entries, raise the low-water mark).
GRANT SELECT, DELETE ON changefeed.feed TO changefeed_publisher;
GRANT SELECT, UPDATE ON changefeed.feed_state TO changefeed_publisher;
-- `changefeed serve` checks at start-up that the schema is there (its version).
GRANT SELECT ON changefeed.schema_migrations TO changefeed_publisher;
-- Without it pg_stat_activity hides other roles' transactions, and
-- changefeed_oldest_open_transaction_seconds would always read 0.
GRANT pg_read_all_stats TO changefeed_publisher;

-- Append entries, only through the functions' shape (they run as the caller).
GRANT INSERT ON changefeed.feed TO changefeed_writer;
REVOKE EXECUTE ON FUNCTION changefeed.publish(text, text[], text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION changefeed.publish_many(text[], text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION changefeed.publish(text, text[], text) TO changefeed_writer;
GRANT EXECUTE ON FUNCTION changefeed.publish_many(text[], text[], text[]) TO changefeed_writer;
-- Triggers: EXECUTE is checked when the API's role creates one; the trigger then
-- appends as whoever writes the table (INSERT above).
REVOKE EXECUTE ON FUNCTION changefeed.publish_row() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION changefeed.publish_row() TO changefeed_writer;
