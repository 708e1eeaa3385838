-- changefeed feed table, version 6: the compaction job's rewrite horizon.
-- The job widens a kept entry's sub-resources in place, and deletes the older
-- entries merged into it. A publisher holds copies of entries in memory (its
-- window of recent entries, pages of the table) made when it read them, which
-- may be from before the job widened them. Before it widens anything, a run
-- announces it here, in its own committed transaction:
--   rewrite_generation     one more than before: pages of the table read under
--                          an older generation may hold entries as they were
--                          before this run's changes;
--   rewritten_through      the newest entry any run has widened, or is about
--                          to (never lowered): a copy made in memory of an entry
--                          at or before it may be out of date.
-- Publishers read both in the same snapshot as every catch-up page and every
-- resume, and serve nothing at or before rewritten_through from memory to a
-- listener reading past the table's changes (docs/compaction.md, "Publishers'
-- copies"). The job's run log and its index of kept entries are its own tables.
ALTER TABLE {schema}.feed_state
    ADD COLUMN rewrite_generation bigint NOT NULL DEFAULT 0,
    ADD COLUMN rewritten_through_txid xid8 NOT NULL DEFAULT '0',
    ADD COLUMN rewritten_through_id bigint NOT NULL DEFAULT 0;
