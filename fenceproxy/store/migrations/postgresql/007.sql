-- Once autovacuum has been through the in-flight table, its statistics say it is all
-- but empty (its live rows are the writes at the upstream, a handful), while between
-- two vacuums it holds a dead row for every write since. Two plans made on those
-- statistics read those dead rows for each admission:
--
-- * the index on expires_at, for "expires_at > now": every dead record has its entry
--   there, still in the future (a record is deleted long before it would expire).
--   The index goes; what reads by expiry (the purge, once a minute, and the gauge of
--   held jobs) reads the table whole.
-- * a sequential scan of the whole table, where the primary key (job, holder) finds
--   the job's few records. The batch's function plans none.
DROP INDEX inflight_expiry;
ALTER FUNCTION fenceproxy_batch(text[], text[], text[], double precision[], text[], boolean[],
    integer[], text[], bytea[], double precision, double precision, bigint[], boolean[])
    SET enable_seqscan = off;
