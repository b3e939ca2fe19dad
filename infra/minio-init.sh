#!/bin/sh
# One-off: create the artifact and checkpoint buckets in MinIO (idempotent). Run by the
# `minio-init` compose service with the MinIO client image; needs MINIO_ROOT_USER/PASSWORD.
set -eu
: "${S3_ENDPOINT:=http://minio:9000}"
: "${KILN_BUCKET:=kiln}"
: "${CHECKPOINT_BUCKET:=checkpoints}"
for i in $(seq 1 30); do
  if mc alias set kiln "$S3_ENDPOINT" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null 2>&1; then
    break
  fi
  echo "waiting for MinIO at $S3_ENDPOINT ($i)"; sleep 1
done
mc mb --ignore-existing "kiln/$KILN_BUCKET"
mc mb --ignore-existing "kiln/$CHECKPOINT_BUCKET"
# Artifacts are immutable once committed: keep versions so an overwrite could be undone.
mc version enable "kiln/$KILN_BUCKET" || true
echo "buckets ready: $KILN_BUCKET, $CHECKPOINT_BUCKET"
