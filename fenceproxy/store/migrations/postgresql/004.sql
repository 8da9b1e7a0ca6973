-- A key is its caller's (fenceproxy.fence.fencing.scope). Keys stored before have no
-- caller: the empty scope matches none, so their answers are replayed to nobody.
-- A proxy from before would store keys without one: the version keeps it out.
ALTER TABLE idempotency_keys ADD COLUMN scope bytea NOT NULL DEFAULT ''::bytea;
