-- No table changes: admissions now take the job's advisory lock, shared, which
-- lease changes take alone. A proxy that does not would admit a write while a
-- claim of the job commits, so proxies from before never share a database with
-- these: the version tells them apart (an old proxy refuses to start on it, and
-- a running one fails its readiness probe).
COMMENT ON TABLE inflight IS
    'admissions and lease changes of a job serialize on its advisory lock (schema 3)';
