-- The in-flight table loses its index on expires_at. Every write adds a row and
-- deletes it long before it would expire, so between two vacuums that index holds
-- an entry, still in the future, for each write since; and once autovacuum has
-- analyzed the table (a handful of live rows, all soon to expire), the planner takes
-- "expires_at > now" for the most selective condition of an admission's reads and
-- scans those entries, every one, for each admission, where the primary key (job,
-- holder) finds the job's few. What read by expiry (the purge, once a minute, and the
-- gauges of held jobs) reads the table whole: its live rows are the writes at the
-- upstream.
DROP INDEX inflight_expiry;
