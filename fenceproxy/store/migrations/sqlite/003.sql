-- The first released schema: each job's fence, its idempotency keys and its lease.
CREATE TABLE IF NOT EXISTS fences (
    job         TEXT PRIMARY KEY,
    generation  INTEGER NOT NULL,
    updated_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS idempotency_keys (
    route       TEXT NOT NULL,
    job         TEXT NOT NULL,
    key         TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint BLOB NOT NULL,
    generation  INTEGER NOT NULL,
    status      INTEGER,
    headers     TEXT,
    body        BLOB,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (route, job, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys (expires_at);
CREATE TABLE IF NOT EXISTS leases (
    job         TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    generation  INTEGER NOT NULL,
    lease_until REAL NOT NULL,
    ttl         REAL NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('held', 'released', 'completed')),
    updated_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (
    key         TEXT PRIMARY KEY,
    value       REAL NOT NULL
) WITHOUT ROWID;
