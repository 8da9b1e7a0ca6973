-- A key is its caller's (fenceproxy.fence.fencing.scope). Keys stored before have no
-- caller: the empty scope matches none, so their answers are replayed to nobody.
ALTER TABLE idempotency_keys ADD COLUMN scope BLOB NOT NULL DEFAULT x'';
