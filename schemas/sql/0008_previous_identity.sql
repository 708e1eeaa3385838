-- changefeed feed table, version 8: the identity before the last rewind.
-- A feed whose history went back (restored from a backup, or a failover that
-- lost the last commits) gets a new identity and key, so that a cursor of the
-- lost entries is never taken for one of the entries written again at the same
-- positions. The identity and key before that are kept here: a cursor of the
-- previous identity still resumes when the feed holds the very entry it names
-- (position and stamp), which no lost entry is. Cursors issued before the
-- rewind, or by publishers that had not noticed it yet (those reading a
-- standby that was promoted), stay good; every listener need not bootstrap.
ALTER TABLE {schema}.feed_state
    ADD COLUMN previous_feed_id uuid,
    ADD COLUMN previous_cursor_key bytea;
