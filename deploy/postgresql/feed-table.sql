-- Storage settings for the feed table of schema "changefeed", for a high-churn
-- feed. Run once after `changefeed db init`, as the schema owner:
--     psql "$OWNER_DSN" -f deploy/postgresql/feed-table.sql
-- Re-running is harmless. (Another schema: replace "changefeed".)
--
-- What the migration already gives (schemas/sql/0001_feed.sql), and why:
--   * PRIMARY KEY (txid, id): the tailer reads "(txid, id) > cursor AND txid <
--     horizon ORDER BY txid, id LIMIT n", an index range scan that costs the
--     same at any feed size; resume replays use the same index.
--   * INDEX (published): retention deletes "published < now() - max_age" in
--     short batches without scanning the table.
--   * fillfactor 100: entries are inserted and deleted, never updated, so
--     space kept free on each page for updates would never be used.
--   * autovacuum scale factors 0.02: vacuum after 2 % of the rows changed,
--     not the default 20 %, which on a large feed means millions of dead rows.
-- No other index: every index is written by every publish. (Many resources in
-- one feed with frequent resumes of one of them: consider
--     CREATE INDEX CONCURRENTLY ON changefeed.feed (resource, txid, id);
-- measure first.)

ALTER TABLE changefeed.feed SET (
    -- Deletes: vacuum once 1000 + 2 % of the rows are dead.
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0.02,
    -- Inserts alone trigger a vacuum too (PostgreSQL 13+), which keeps the
    -- visibility map current for the tailer's index scans even while
    -- retention is off (Spark compacts once a day, say).
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    -- Never throttle this table's vacuum: it is small per run and must keep pace.
    autovacuum_vacuum_cost_delay = 0,
    fillfactor = 100
);

-- feed_state is one row, updated by every retention batch: HOT updates on a
-- page with room to spare; the default settings are right for it.
