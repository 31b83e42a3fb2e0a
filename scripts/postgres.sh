#!/usr/bin/env bash
# Make a PostgreSQL test database available and print its SQLAlchemy URL on stdout.
# Installs PostgreSQL from Debian's packages when missing (root only), starts the cluster,
# creates role and database `rtrl_test`. Prints nothing (exit 0) when it cannot, so that
# outside CI the PostgreSQL tests skip; in CI the suite refuses to skip them.
set -euo pipefail
log() { echo "postgres.sh: $*" >&2; }
if ! command -v pg_ctlcluster >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then log "PostgreSQL is not installed and we are not root: skipping"; exit 0; fi
  log "installing PostgreSQL from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2 && apt-get install -y -qq postgresql >&2
fi
if [ "$(id -u)" != 0 ]; then log "not root: cannot start the cluster; set RTRL_TEST_POSTGRES yourself"; exit 0; fi
read -r ver cluster < <(pg_lsclusters -h | awk 'NR==1 {print $1, $2}')
if [ -z "${ver:-}" ]; then
  ver=$(ls /usr/lib/postgresql | sort -V | tail -1); cluster=main
  pg_createcluster "$ver" "$cluster" >&2
fi
pg_ctlcluster "$ver" "$cluster" start >/dev/null 2>&1 || true  # "already running" is fine
port=$(pg_lsclusters -h | awk -v v="$ver" -v c="$cluster" '$1==v && $2==c {print $3}')
for _ in $(seq 1 60); do su postgres -c "pg_isready -q -p $port" && break; sleep 0.5; done
su postgres -c "psql -q -p $port -tc \"SELECT 1 FROM pg_roles WHERE rolname='rtrl_test'\"" | grep -q 1 \
  || su postgres -c "psql -q -p $port -c \"CREATE ROLE rtrl_test LOGIN SUPERUSER PASSWORD 'rtrl_test'\"" >&2
su postgres -c "psql -q -p $port -tc \"SELECT 1 FROM pg_database WHERE datname='rtrl_test'\"" | grep -q 1 \
  || su postgres -c "psql -q -p $port -c \"CREATE DATABASE rtrl_test OWNER rtrl_test\"" >&2
echo "postgresql+psycopg://rtrl_test:rtrl_test@127.0.0.1:${port}/rtrl_test"
