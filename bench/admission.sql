-- pgbench's admission-shaped transaction (bench/run.py's "pgbench" row): what a
-- fenced write asks of PostgreSQL at the least, one statement per round trip and
-- two commits, as when nothing is batched. Its rate is the database's own ceiling
-- on this machine, for fenceproxy's PostgreSQL rows to be read against.
\set job random(0, 999)
BEGIN;
INSERT INTO fences AS f (job, generation, updated_at) VALUES ('pgbench-' || :job, 1, 0)
    ON CONFLICT (job) DO UPDATE
    SET generation = GREATEST(f.generation, excluded.generation), updated_at = excluded.updated_at;
INSERT INTO inflight AS i (job, holder, state, expires_at, generation, shared)
    VALUES ('pgbench-' || :job, 'client-' || :client_id, 'in_flight', 1e12, 1, false)
    ON CONFLICT (job, holder) DO UPDATE
    SET state = 'in_flight', expires_at = excluded.expires_at;
COMMIT;
DELETE FROM inflight WHERE job = 'pgbench-' || :job AND holder = 'client-' || :client_id;
