-- The first schema: each job's fence, its idempotency keys, its lease and its
-- in-flight record.
CREATE TABLE fences (
    job         text PRIMARY KEY,
    generation  bigint NOT NULL,
    updated_at  double precision NOT NULL
);
CREATE TABLE idempotency_keys (
    route       text NOT NULL,
    job         text NOT NULL,
    key         text NOT NULL,
    state       text NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint bytea NOT NULL,
    generation  bigint NOT NULL,
    holder      text,
    status      integer,
    headers     text,
    body        bytea,
    created_at  double precision NOT NULL,
    expires_at  double precision NOT NULL,
    PRIMARY KEY (route, job, key)
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);
CREATE TABLE leases (
    job         text PRIMARY KEY,
    owner       text NOT NULL,
    generation  bigint NOT NULL,
    lease_until double precision NOT NULL,
    ttl         double precision NOT NULL,
    state       text NOT NULL CHECK (state IN ('held', 'released', 'completed')),
    updated_at  double precision NOT NULL
);
CREATE TABLE inflight (
    job         text PRIMARY KEY,
    holder      text NOT NULL,
    state       text NOT NULL CHECK (state IN ('in_flight', 'unknown')),
    expires_at  double precision NOT NULL
);
CREATE INDEX inflight_expiry ON inflight (expires_at);
