-- A job's in-flight records are a set, one per write that may be at the upstream
-- (fenceproxy.leases.model.in_the_way): writes of one generation on a route in
-- generation order go together. Admissions now take the job's advisory lock
-- alone, as lease changes do: no row is theirs to wait on. A record from before
-- holds its job as it did, alone, until it expires. A proxy from before would take
-- the one record per job: the version keeps it out.
ALTER TABLE inflight ADD COLUMN generation bigint NOT NULL DEFAULT 0,
    ADD COLUMN shared boolean NOT NULL DEFAULT false;
ALTER TABLE inflight DROP CONSTRAINT inflight_pkey, ADD PRIMARY KEY (job, holder);

-- One batch's first step, in one call (see PostgresStore._run_batch). Its arrays hold
-- one operation each, sorted by job: every row lock and advisory lock a batch takes is
-- taken job after job in that one order, whatever the operations' kinds, so two
-- batches (of one proxy or of two) never wait for each other in a circle. A take
-- holds the job's advisory lock until the commit, and adds its in-flight record when
-- none is in its way; the reads that follow are a statement of their own, so they see
-- every commit made before the lock was won. They look each row up by its key: one
-- join over every take of the batch was planned as scans of whole tables.
DROP FUNCTION fenceproxy_batch(text[], text[], text[], double precision[], text[], boolean[],
    integer[], text[], bytea[], double precision, double precision);
CREATE FUNCTION fenceproxy_batch(
    kinds text[], jobs text[], turns text[], seconds double precision[], keys text[],
    check_leases boolean[], statuses integer[], headers text[], bodies bytea[],
    clock double precision, key_ttl double precision, generations bigint[], shared boolean[]
) RETURNS TABLE (
    r_n integer, r_now double precision, r_changed boolean, r_got boolean,
    r_prior_holder text, r_prior_state text, r_prior_expires double precision,
    r_record_state text, r_record_expires double precision, r_fence bigint,
    r_key_state text, r_key_fingerprint bytea, r_key_status integer, r_key_headers text,
    r_key_body bytea, r_key_live boolean, r_key_scope bytea,
    r_lease_job text, r_lease_owner text, r_lease_generation bigint,
    r_lease_until double precision, r_lease_ttl double precision, r_lease_state text
) LANGUAGE plpgsql AS $$
DECLARE
    n integer;
    t double precision;
    changed integer;
    prior inflight%ROWTYPE;
    way_until double precision;
    way_unknown boolean;
BEGIN
    FOR n IN 1 .. coalesce(array_length(kinds, 1), 0) LOOP
        IF kinds[n] = 'take' THEN
            PERFORM pg_advisory_xact_lock(hashtextextended(jobs[n], 0));
            -- The job's live records in this write's way, in a statement of its own so
            -- it sees every commit made before the lock was won: any other write's in
            -- job order; in generation order, any but the shared ones of its generation
            -- (fenceproxy.leases.model.in_the_way).
            t := coalesce(clock, extract(epoch FROM clock_timestamp())::double precision);
            SELECT max(i.expires_at), bool_or(i.state = 'unknown') INTO way_until, way_unknown
            FROM inflight i
            WHERE i.job = jobs[n] AND i.holder <> turns[n] AND i.expires_at > t
              AND NOT (fenceproxy_batch.shared[n] AND i.shared AND i.generation = generations[n]);
            -- What this write's own record was, to put back if the write is refused.
            prior := NULL;
            changed := 0;
            IF way_until IS NULL THEN
                SELECT * INTO prior FROM inflight i
                WHERE i.job = jobs[n] AND i.holder = turns[n] FOR UPDATE;
                INSERT INTO inflight AS i (job, holder, state, expires_at, generation, shared)
                VALUES (jobs[n], turns[n], 'in_flight', t + seconds[n], generations[n],
                        fenceproxy_batch.shared[n])
                ON CONFLICT (job, holder) DO UPDATE
                    SET state = 'in_flight', expires_at = excluded.expires_at,
                        generation = excluded.generation, shared = excluded.shared;
                changed := 1;
            END IF;
            -- What the write is decided on, each row found by its key, in a statement
            -- of its own: it sees every commit made before the record was won, and no
            -- admission or lease change of the job can commit until this batch does.
            t := coalesce(clock, extract(epoch FROM clock_timestamp())::double precision);
            RETURN QUERY
            SELECT n, t, NULL::boolean, changed > 0, prior.holder, prior.state,
                   prior.expires_at,
                   CASE WHEN way_unknown THEN 'unknown' ELSE 'in_flight' END, way_until,
                   (SELECT f.generation FROM fences f WHERE f.job = jobs[n]),
                   k.state, k.fingerprint, k.status, k.headers, k.body,
                   EXISTS (SELECT 1 FROM inflight h WHERE h.job = k.job AND h.holder = k.holder
                           AND h.expires_at > t),
                   k.scope, l.job, l.owner, l.generation, l.lease_until, l.ttl, l.state
            FROM (SELECT) AS one
            LEFT JOIN idempotency_keys k ON k.job = jobs[n] AND k.key = keys[n]
                AND (k.expires_at > t
                     OR (k.state = 'in_flight' AND EXISTS (SELECT 1 FROM inflight h
                         WHERE h.job = k.job AND h.holder = k.holder AND h.expires_at > t)))
            LEFT JOIN leases l ON l.job = jobs[n] AND check_leases[n];
            CONTINUE;
        END IF;
        t := coalesce(clock, extract(epoch FROM clock_timestamp())::double precision);
        IF kinds[n] = 'end' THEN
            DELETE FROM inflight WHERE job = jobs[n] AND holder = turns[n];
        ELSIF kinds[n] = 'hold' THEN
            UPDATE inflight SET state = 'unknown', expires_at = GREATEST(expires_at, t + seconds[n])
            WHERE job = jobs[n] AND holder = turns[n];
        ELSIF kinds[n] = 'complete' THEN
            UPDATE idempotency_keys SET state = 'completed', status = statuses[n],
                headers = fenceproxy_batch.headers[n], body = bodies[n],
                expires_at = GREATEST(expires_at, t + key_ttl)
            WHERE job = jobs[n] AND key = keys[n] AND state = 'in_flight' AND holder = turns[n];
        ELSIF kinds[n] = 'unknown' THEN
            UPDATE idempotency_keys SET state = 'unknown',
                expires_at = GREATEST(expires_at, t + key_ttl)
            WHERE job = jobs[n] AND key = keys[n] AND state = 'in_flight' AND holder = turns[n];
        ELSIF kinds[n] = 'forget' THEN
            DELETE FROM idempotency_keys
            WHERE job = jobs[n] AND key = keys[n] AND state = 'in_flight' AND holder = turns[n];
        ELSE
            RAISE EXCEPTION 'fenceproxy_batch: no operation %', kinds[n];
        END IF;
        GET DIAGNOSTICS changed = ROW_COUNT;
        r_n := n;
        r_changed := changed > 0;
        RETURN NEXT;
    END LOOP;
END
$$;
