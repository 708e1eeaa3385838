-- changefeed feed table, version 5: the feed's identity and its cursor key.
-- Cursors carry the feed's identity, so that a cursor of another feed (another
-- database, a feed created again) is never resumed, and they are signed with a
-- key made here, with the feed, and kept only in the database: no deployment
-- signs cursors with a key anyone else knows. Upgrading gives an existing feed
-- its identity and key at once: cursors issued before are then another feed's,
-- and their listeners bootstrap once.
-- A feed restored from a backup keeps its identity, but its transaction ids and
-- entry ids go back: the first publisher that notices (a cursor or its own
-- position naming an entry the feed does not hold) gives it a new identity.
-- compacted_through: the newest entry compaction has merged away. A cursor at
-- or before it may name an entry that was merged into a later one, which is no
-- sign of a restored feed.
ALTER TABLE {schema}.feed_state
    ADD COLUMN feed_id uuid NOT NULL DEFAULT gen_random_uuid(),
    ADD COLUMN cursor_key bytea NOT NULL
        DEFAULT uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()),
    ADD COLUMN compacted_through_txid xid8 NOT NULL DEFAULT '0',
    ADD COLUMN compacted_through_id bigint NOT NULL DEFAULT 0;
