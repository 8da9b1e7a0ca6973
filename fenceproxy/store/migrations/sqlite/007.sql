-- A job's in-flight records are a set, one per write that may be at the upstream
-- (fenceproxy.leases.model.in_the_way): writes of one generation on a route in
-- generation order go together. A record from before holds its job as it did,
-- alone, until it expires.
CREATE TABLE inflight_writes (
    job         TEXT NOT NULL,
    holder      TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('in_flight', 'unknown')),
    expires_at  REAL NOT NULL,
    generation  INTEGER NOT NULL,
    shared      INTEGER NOT NULL CHECK (shared IN (0, 1)),
    PRIMARY KEY (job, holder)
) WITHOUT ROWID;
INSERT INTO inflight_writes (job, holder, state, expires_at, generation, shared)
SELECT job, holder, state, expires_at, 0, 0 FROM inflight;
DROP TABLE inflight;
ALTER TABLE inflight_writes RENAME TO inflight;
CREATE INDEX inflight_expiry ON inflight (expires_at);
