-- In-flight records per job replace the whole-store crash hold: a key in flight
-- belongs to the write holding its job's record (holder). Keys left in flight
-- by a version-3 process cannot be tied to one, so they read as unknown.
CREATE TABLE inflight (
    job         TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('in_flight', 'unknown')),
    expires_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX inflight_expiry ON inflight (expires_at);
ALTER TABLE idempotency_keys ADD COLUMN holder TEXT;
UPDATE idempotency_keys SET state = 'unknown' WHERE state = 'in_flight';
DROP TABLE meta;
