"""What pins an artifact's manifest (the one file no manifest can list with a digest: itself).

An artifact id is a digest of what the artifact was converted from and for (source, target, tp,
method, options, kernel layout versions: `manifest.artifact_id`), not of the manifest's bytes, so
the id alone cannot pin the rest of the manifest (model config, layer specs, file digests). Two
things do:

* **The user's pin**: a URI may end in `@sha256:<64 hex digits>`, the manifest's sha256
  (`kiln pull` prints it): `kiln pull s3://bucket/prefix/ka-…@sha256:…` or `kiln pull DIR@sha256:…`.
  A manifest with another digest is refused before anything is downloaded or loaded.
* **The pull's record**: a pull from S3 writes the sha256 of the manifest it fetched into
  `.manifest.sha256` beside it (a hidden name, which no manifest may list). A cache hit and
  `--verify` compare the manifest with it, so a cached manifest edited after the pull is refused
  (or, on a pull, fetched again). Whoever can write the cache can rewrite both: against that, pin.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from runtime.artifact.cache_files import read_own_file, replace_atomically
from runtime.artifact.manifest import MANIFEST_NAME, ManifestError

PIN_MARK = "@sha256:"
RECORD_NAME = ".manifest.sha256"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class ManifestPinError(ManifestError):
    """The manifest is not the one pinned (by the URI, or by the pull that fetched it)."""


def split_pin(uri: str) -> tuple[str, str | None]:
    """(`uri` without its pin, the pinned sha256 or None)."""
    base, mark, digest = uri.rpartition(PIN_MARK)
    if not mark:
        return uri, None
    if not _DIGEST_RE.fullmatch(digest):
        raise ManifestPinError(
            f"{uri}: a manifest pin is {PIN_MARK} followed by 64 lowercase hex digits (the sha256 "
            "`kiln pull` prints)"
        )
    return base, digest


def manifest_sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def check_pin(raw: bytes, where: str, pin: str | None) -> None:
    """The manifest bytes `raw` against the URI's pin, if any."""
    if pin is not None and manifest_sha256(raw) != pin:
        raise ManifestPinError(
            f"{where}: sha256 {manifest_sha256(raw)}, the URI pins {pin}: this is not the manifest you "
            "pinned (altered, or another artifact); nothing was downloaded or loaded"
        )


def record(artifact_dir: Path, raw: bytes) -> None:
    """Remember the sha256 of the manifest a pull fetched (written before the manifest itself)."""
    replace_atomically(artifact_dir / RECORD_NAME, (manifest_sha256(raw) + "\n").encode())


def recorded(artifact_dir: Path) -> str | None:
    """The sha256 a pull recorded for this artifact's manifest; None for artifacts not pulled, and
    `"unreadable"` for a record that is not one (a link, or not a digest)."""
    path = artifact_dir / RECORD_NAME
    if not os.path.lexists(path):
        return None
    data = read_own_file(path, 128)
    text = data.decode(errors="replace").strip() if data is not None else ""
    return text if _DIGEST_RE.fullmatch(text) else "unreadable"


def check_recorded(artifact_dir: Path, raw: bytes) -> None:
    """The manifest bytes `raw` against the digest the pull recorded, when it recorded one."""
    expected = recorded(artifact_dir)
    if expected is not None and manifest_sha256(raw) != expected:
        raise ManifestPinError(
            f"{artifact_dir / MANIFEST_NAME}: sha256 {manifest_sha256(raw)}, but it was {expected} when "
            f"it was pulled: the manifest was changed in the cache — delete {artifact_dir} and pull the "
            "artifact again"
        )
