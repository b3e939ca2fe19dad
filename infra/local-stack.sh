#!/usr/bin/env bash
# The compose stack without Docker, for development on one machine (loopback only):
#   moto_server (S3 protocol) + `kiln api` + `kiln worker`, against the machine's Redis and PostgreSQL.
#
#   infra/local-stack.sh start     # prints the API URL and an admin token, writes var/local-stack/env
#   infra/local-stack.sh stop      # stops the processes it started (by their recorded pids)
#   infra/local-stack.sh status
#
# Knobs (env): KILN_LOCAL_API_PORT (8000), KILN_LOCAL_S3_PORT (9000), KILN_LOCAL_DB (kiln_local),
# KILN_LOCAL_REDIS_DB (1), PYTHON (.venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STATE="$ROOT/var/local-stack"
PY=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PY")
API_PORT=${KILN_LOCAL_API_PORT:-8000}
S3_PORT=${KILN_LOCAL_S3_PORT:-9000}
DB=${KILN_LOCAL_DB:-kiln_local}
REDIS_DB=${KILN_LOCAL_REDIS_DB:-1}
mkdir -p "$STATE"

write_env() {
  cat > "$STATE/env" <<ENV
export KILN_ENVIRONMENT=development
export KILN_DATA_DIR=$STATE/data
export KILN_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/$DB
export KILN_BROKER_URL=redis://127.0.0.1:6379/$REDIS_DB
export KILN_STORE_URL=s3://kiln/artifacts
export KILN_S3_ENDPOINT_URL=http://127.0.0.1:$S3_PORT
export KILN_S3_ACCESS_KEY_ID=local
export KILN_S3_SECRET_ACCESS_KEY=local-secret
export KILN_S3_REGION=us-east-1
export AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local-secret AWS_DEFAULT_REGION=us-east-1
ENV
}

running() { [[ -f "$STATE/$1.pid" ]] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }

launch() {  # name, command...
  local name=$1; shift
  if running "$name"; then echo "$name already running (pid $(cat "$STATE/$name.pid"))"; return; fi
  nohup "$@" > "$STATE/$name.log" 2>&1 &
  echo $! > "$STATE/$name.pid"
  echo "started $name (pid $!, log $STATE/$name.log)"
}

wait_http() {  # url, seconds
  for _ in $(seq 1 "$2"); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 1; done
  echo "no answer from $1" >&2; return 1
}

start() {
  bash "$ROOT/infra/ensure-services.sh" >/dev/null
  write_env
  # shellcheck disable=SC1091
  source "$STATE/env"
  psql -h 127.0.0.1 -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='$DB'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE \"$DB\"" >/dev/null
  launch s3 "$BIN/moto_server" -H 127.0.0.1 -p "$S3_PORT"
  wait_http "http://127.0.0.1:$S3_PORT/moto-api/" 30
  "$PY" - <<PYEOF
import boto3
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:$S3_PORT")
for bucket in ("kiln", "checkpoints"):
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
PYEOF
  "$BIN/kiln" db upgrade
  launch worker "$BIN/kiln" worker --concurrency 1
  launch api "$BIN/kiln" api --host 127.0.0.1 --port "$API_PORT"
  wait_http "http://127.0.0.1:$API_PORT/health" 60
  if [[ ! -f "$STATE/admin-token" ]]; then
    "$BIN/kiln" admin create-token --admin --name local-stack --out "$STATE/admin-token" >/dev/null
  fi
  echo "API:   http://127.0.0.1:$API_PORT  (OpenAPI: /docs)"
  echo "token: $(cat "$STATE/admin-token")"
  echo "env:   source $STATE/env"
}

stop() {
  for name in api worker s3; do
    if running "$name"; then
      kill "$(cat "$STATE/$name.pid")" && echo "stopped $name"
    fi
    rm -f "$STATE/$name.pid"
  done
}

status() {
  for name in s3 worker api; do
    if running "$name"; then echo "$name: running (pid $(cat "$STATE/$name.pid"))"; else echo "$name: stopped"; fi
  done
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
