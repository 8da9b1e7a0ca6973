-- Admissions and settlements in batches: one call takes the in-flight records and
-- settles what ended, job by job in the order given, then reads what each
-- admission decides on. A proxy from before would not take its jobs in order, so
-- could deadlock with these: the version keeps it out.
--
-- One batch's first step, in one call (see PostgresStore._run_batch), with one
-- in-flight record per job; 006.sql replaces it.
CREATE FUNCTION fenceproxy_batch(
    kinds text[], jobs text[], turns text[], seconds double precision[], keys text[],
    check_leases boolean[], statuses integer[], headers text[], bodies bytea[],
    clock double precision, key_ttl double precision
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
BEGIN
    FOR n IN 1 .. coalesce(array_length(kinds, 1), 0) LOOP
        IF kinds[n] = 'take' THEN
            PERFORM pg_advisory_xact_lock_shared(hashtextextended(jobs[n], 0));
            -- What the record was, to put back if the write is refused.
            prior := NULL;
            SELECT * INTO prior FROM inflight i WHERE i.job = jobs[n] FOR UPDATE;
            t := coalesce(clock, extract(epoch FROM clock_timestamp())::double precision);
            INSERT INTO inflight AS i (job, holder, state, expires_at)
            VALUES (jobs[n], turns[n], 'in_flight', t + seconds[n])
            ON CONFLICT (job) DO UPDATE
                SET holder = excluded.holder, state = 'in_flight', expires_at = excluded.expires_at
                WHERE i.expires_at <= t OR i.holder = excluded.holder;
            GET DIAGNOSTICS changed = ROW_COUNT;
            -- What the write is decided on, each row found by its key, in a statement
            -- of its own: it sees every commit made before the record was won, and no
            -- admission or lease change of the job can commit until this batch does.
            t := coalesce(clock, extract(epoch FROM clock_timestamp())::double precision);
            RETURN QUERY
            SELECT n, t, NULL::boolean, changed > 0, prior.holder, prior.state,
                   prior.expires_at, i.state, i.expires_at,
                   (SELECT f.generation FROM fences f WHERE f.job = jobs[n]),
                   k.state, k.fingerprint, k.status, k.headers, k.body,
                   EXISTS (SELECT 1 FROM inflight h WHERE h.job = k.job AND h.holder = k.holder
                           AND h.expires_at > t),
                   k.scope, l.job, l.owner, l.generation, l.lease_until, l.ttl, l.state
            FROM (SELECT) AS one
            LEFT JOIN inflight i ON i.job = jobs[n]
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
