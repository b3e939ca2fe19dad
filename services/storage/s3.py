"""S3 artifact store and S3 checkpoint sources on boto3 (MinIO, AWS, or moto's server in tests).

Writes: every file is uploaded under `{prefix}/.staging/{id}-{random}/` (multipart with bounded
memory: boto3's TransferConfig chunk size x concurrency, with a ChecksumSHA256 per part), then
copied to `{prefix}/{id}/` and `manifest.json` is put last with `If-None-Match: *`, so a second
writer cannot overwrite a committed manifest. Staged objects are deleted after the commit and on
any failure; final objects copied by a writer that loses the race are removed again.

Reads: sources are streamed with ranged GETs (`read_range`), never downloaded whole.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.artifact.manifest import MANIFEST_NAME
from runtime.artifact.s3_client import make_client
from services.storage.base import HASH_CHUNK, ArtifactStore, ArtifactWriter, SourceReader
from services.storage.errors import ArtifactExistsError, NotFoundError, StorageError
from services.storage.keys import check_artifact_id, check_name, join_prefix

if TYPE_CHECKING:
    from runtime.settings import RuntimeSettings
    from services.settings import ServiceSettings

STAGING_PREFIX = ".staging"


def parse_s3_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise StorageError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise StorageError(f"s3 URL {url!r} has no bucket: use s3://bucket/prefix")
    prefix = prefix.strip("/")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", "..") or "\0" in part:
                raise StorageError(f"invalid s3 prefix in {url!r}")
    return bucket, prefix


def transfer_config(settings: ServiceSettings) -> Any:
    from boto3.s3.transfer import TransferConfig

    chunk = settings.s3_multipart_chunk_mb << 20
    return TransferConfig(
        multipart_threshold=chunk,
        multipart_chunksize=chunk,
        max_concurrency=settings.s3_max_concurrency,
        use_threads=settings.s3_max_concurrency > 1,
    )


def _is_missing(err: Exception) -> bool:
    code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _is_precondition_failed(err: Exception) -> bool:
    resp = getattr(err, "response", {})
    code = str(resp.get("Error", {}).get("Code", ""))
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status in (409, 412)


class S3Writer(ArtifactWriter):
    def __init__(self, store: S3Store, aid: str) -> None:
        self.store = store
        self.aid = aid
        self.staging = join_prefix(store.prefix, STAGING_PREFIX, f"{aid}-{secrets.token_hex(6)}")
        self.names: list[str] = []
        self._done = False

    def _key(self, name: str) -> str:
        check_name(name)
        if name == MANIFEST_NAME:
            raise StorageError("manifest.json is written by commit(), not put_*")
        self.names.append(name)
        return join_prefix(self.staging, name)

    def put_file(
        self, name: str, path: Path, *, move: bool = False, sha256: str | None = None
    ) -> tuple[int, str]:
        key = self._key(name)
        size = path.stat().st_size
        if sha256 is None:
            h = hashlib.sha256()
            with path.open("rb") as f:
                while block := f.read(HASH_CHUNK):
                    h.update(block)
            sha256 = h.hexdigest()
        self.store.client.upload_file(
            str(path),
            self.store.bucket,
            key,
            ExtraArgs={"ChecksumAlgorithm": "SHA256"},
            Config=self.store.transfer,
        )
        if move:
            path.unlink(missing_ok=True)
        return size, sha256

    def put_bytes(self, name: str, data: bytes) -> tuple[int, str]:
        key = self._key(name)
        self.store.client.put_object(Bucket=self.store.bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256")
        return len(data), hashlib.sha256(data).hexdigest()

    def commit(self, manifest_bytes: bytes) -> None:
        store = self.store
        if store.exists(self.aid):
            self.abort()
            raise ArtifactExistsError(f"artifact {self.aid} is already committed at {store.uri(self.aid)}")
        copied: list[str] = []
        try:
            for name in self.names:
                dest = store.key(self.aid, name)
                store.client.copy(
                    {"Bucket": store.bucket, "Key": join_prefix(self.staging, name)},
                    store.bucket,
                    dest,
                    Config=store.transfer,
                )
                copied.append(dest)
            store.client.put_object(
                Bucket=store.bucket,
                Key=store.key(self.aid, MANIFEST_NAME),
                Body=manifest_bytes,
                IfNoneMatch="*",
                ChecksumAlgorithm="SHA256",
            )
        except Exception as e:
            if not _is_precondition_failed(e):
                store.delete_keys(copied)
            self.abort()
            if _is_precondition_failed(e):
                raise ArtifactExistsError(f"artifact {self.aid} was committed by another writer") from e
            raise
        self._cleanup_staging()
        self._done = True

    def _cleanup_staging(self) -> None:
        self.store.delete_keys(self.store.list_keys(self.staging + "/"))

    def abort(self) -> None:
        if not self._done:
            self._cleanup_staging()
            self._done = True


class S3Store(ArtifactStore):
    def __init__(self, url: str, settings: ServiceSettings, client: Any | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.settings = settings
        self.client = client or make_client(settings)
        self.transfer = transfer_config(settings)

    def key(self, aid: str, name: str) -> str:
        return join_prefix(self.prefix, check_artifact_id(aid), check_name(name))

    def uri(self, aid: str) -> str:
        return "s3://" + join_prefix(self.bucket, self.prefix, check_artifact_id(aid))

    def exists(self, aid: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(aid, MANIFEST_NAME))
            return True
        except Exception as e:
            if _is_missing(e):
                return False
            raise

    def begin(self, aid: str) -> S3Writer:
        return S3Writer(self, check_artifact_id(aid))

    def read_manifest(self, aid: str) -> bytes:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.key(aid, MANIFEST_NAME))
        except Exception as e:
            if _is_missing(e):
                raise NotFoundError(f"artifact {aid} not found at {self.uri(aid)}") from e
            raise
        return obj["Body"].read()

    def list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys

    def delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            if batch:
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )

    def presigned_urls(self, aid: str) -> dict[str, str]:
        import json

        manifest = json.loads(self.read_manifest(aid))
        names = [MANIFEST_NAME, *(f["name"] for f in manifest.get("files", []))]
        return {
            name: self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.key(aid, name)},
                ExpiresIn=self.settings.presigned_url_ttl_s,
            )
            for name in names
        }

    def delete(self, aid: str) -> None:
        if not self.exists(aid):
            raise NotFoundError(f"artifact {aid} not found at {self.uri(aid)}")
        self.client.delete_object(Bucket=self.bucket, Key=self.key(aid, MANIFEST_NAME))
        self.delete_keys(self.list_keys(join_prefix(self.prefix, aid) + "/"))

    def list_ids(self) -> list[str]:
        base = join_prefix(self.prefix) + "/" if self.prefix else ""
        ids = []
        for key in self.list_keys(base):
            rest = key[len(base) :]
            aid, _, name = rest.partition("/")
            if name == MANIFEST_NAME and not aid.startswith("."):
                ids.append(aid)
        return sorted(ids)

    def discard_staged(self, aid: str) -> int:
        """Remove objects earlier (dead) writers staged for `aid`; returns how many were removed."""
        check_artifact_id(aid)
        keys = self.list_keys(join_prefix(self.prefix, STAGING_PREFIX, f"{aid}-"))
        self.delete_keys(keys)
        return len(keys)

    def sweep_staging(self, older_than_s: float) -> int:
        """Remove staging directories whose newest object is older than `older_than_s` (left by a
        writer that died or lost the store mid-upload; no live writer stages for longer than a job's
        hard time limit). Returns how many objects were removed."""
        base = join_prefix(self.prefix, STAGING_PREFIX) + "/"
        newest: dict[str, float] = {}
        keys: dict[str, list[str]] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                stage = obj["Key"][len(base) :].partition("/")[0]
                keys.setdefault(stage, []).append(obj["Key"])
                newest[stage] = max(newest.get(stage, 0.0), obj["LastModified"].timestamp())
        cutoff = time.time() - older_than_s
        stale = [k for stage, ks in keys.items() if newest[stage] < cutoff for k in ks]
        self.delete_keys(stale)
        return len(stale)

    def staging_keys(self) -> list[str]:
        """Leftover staged objects (for tests and cleanup tools)."""
        return self.list_keys(join_prefix(self.prefix, STAGING_PREFIX) + "/")


class S3Source(SourceReader):
    """A checkpoint under s3://bucket/prefix, read with ranged GETs."""

    def __init__(self, url: str, settings: RuntimeSettings, client: Any | None = None) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.client = client or make_client(settings)
        self.uri = url.rstrip("/")
        self._sizes: dict[str, int] | None = None

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            base = self.prefix + "/" if self.prefix else ""
            from botocore.exceptions import BotoCoreError, ClientError

            sizes: dict[str, int] = {}
            paginator = self.client.get_paginator("list_objects_v2")
            try:
                for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                    for obj in page.get("Contents", []):
                        name = obj["Key"][len(base) :]
                        if name and not name.endswith("/"):
                            sizes[name] = obj["Size"]
            except (ClientError, BotoCoreError) as e:  # named for the user, not a traceback
                raise self._listing_error(e) from e
            if not sizes:
                raise NotFoundError(f"no objects under {self.uri}: is the checkpoint uploaded there?")
            self._sizes = sizes
        return self._sizes

    def _listing_error(self, err: Exception) -> StorageError:
        code = str(getattr(err, "response", {}).get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return NotFoundError(f"{self.uri}: bucket {self.bucket!r} does not exist; check the source URL")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return StorageError(
                f"{self.uri}: listing the checkpoint was refused ({code}); check the S3 credentials "
                "(KILN_S3_*) and the bucket policy"
            )
        return StorageError(f"{self.uri}: the checkpoint cannot be listed ({code or type(err).__name__})")

    def _key(self, name: str) -> str:
        return join_prefix(self.prefix, check_name(name))

    def list(self) -> list[str]:
        return sorted(self._listing())

    def exists(self, name: str) -> bool:
        return name in self._listing()

    def size(self, name: str) -> int:
        try:
            return self._listing()[name]
        except KeyError as e:
            raise NotFoundError(f"{self.uri}/{name} not found") from e

    def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        rng = f"bytes={start}-{end - 1}"
        obj = self.client.get_object(Bucket=self.bucket, Key=self._key(name), Range=rng)
        return obj["Body"].read()

    def sha256(self, name: str) -> str:
        obj = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        h = hashlib.sha256()
        for block in obj["Body"].iter_chunks(HASH_CHUNK):
            h.update(block)
        return h.hexdigest()
