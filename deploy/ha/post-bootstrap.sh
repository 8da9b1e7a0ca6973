#!/bin/sh
# Patroni runs this once, on the node that bootstraps the cluster, with a URL that
# reaches it as the superuser: the role and database fenceproxy uses. pg_monitor lets
# the role see the standbys' state, which `?require_sync=true` checks.
set -eu
psql "$1" -v ON_ERROR_STOP=1 -v password="$FENCEPROXY_DB_PASSWORD" <<'SQL'
CREATE ROLE fenceproxy LOGIN PASSWORD :'password';
GRANT pg_monitor TO fenceproxy;
CREATE DATABASE fenceproxy OWNER fenceproxy;
SQL
