-- A key is its job's, whatever route it came by: renaming a route (a reload, say)
-- must not let a retried write through as new. Where one key of a job was used on
-- two routes, the newest stays.
CREATE TABLE idempotency_keys_of_jobs (
    job         TEXT NOT NULL,
    key         TEXT NOT NULL,
    route       TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint BLOB NOT NULL,
    generation  INTEGER NOT NULL,
    holder      TEXT,
    status      INTEGER,
    headers     TEXT,
    body        BLOB,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (job, key)
) WITHOUT ROWID;
INSERT INTO idempotency_keys_of_jobs (job, key, route, state, fingerprint, generation,
    holder, status, headers, body, created_at, expires_at)
SELECT job, key, route, state, fingerprint, generation, holder, status, headers, body,
    created_at, expires_at
FROM idempotency_keys k WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys o
    WHERE o.job = k.job AND o.key = k.key
    AND (o.created_at > k.created_at OR (o.created_at = k.created_at AND o.route > k.route)));
DROP TABLE idempotency_keys;
ALTER TABLE idempotency_keys_of_jobs RENAME TO idempotency_keys;
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);
