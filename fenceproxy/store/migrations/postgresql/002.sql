-- A key is its job's, whatever route it came by: renaming a route (a reload, say)
-- must not let a retried write through as new. Where one key of a job was used on
-- two routes, the newest stays.
DELETE FROM idempotency_keys k USING idempotency_keys o
WHERE o.job = k.job AND o.key = k.key
  AND (o.created_at > k.created_at OR (o.created_at = k.created_at AND o.route > k.route));
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD PRIMARY KEY (job, key);
