"""What the services may show of an error: credentials and server paths redacted.

`redact_url` masks the password of one URL (`redis://:***@host:6379/0`) and the values of
secret-looking query parameters; `redact_text` does the same to every URL inside free text such as
an exception message. Both leave text without credentials unchanged.

`public_error(message, source)` is the one cleaning of an error about a submitted source, used for a
job's error (services/worker/jobs.py) and a plan's (POST /v1/plans): URLs redacted and, for a
server-local source, no server path but the one submitted. `local_source_problem(source)` is the one
answer for a server-local path that is not a checkpoint directory, whatever the reason (missing, a
file, unreadable, a symlink elsewhere, no config.json), so that neither can map the server's
filesystem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from services.storage.errors import StorageError
from services.storage.keys import resolve_inside

MASK = "***"
_SECRET_PARAMS = re.compile(r"pass|secret|token|signature|credential|key", re.IGNORECASE)
# scheme://anything-up-to-whitespace-or-a-quote
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def _redact_netloc(netloc: str) -> str:
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        return netloc
    user, colon, _password = userinfo.partition(":")
    return f"{user}:{MASK}@{hostport}" if colon else f"{MASK}@{hostport}"


def _redact_query(query: str) -> str:
    if not query:
        return query
    pairs = parse_qsl(query, keep_blank_values=True)
    masked = [(k, MASK if _SECRET_PARAMS.search(k) else v) for k, v in pairs]
    return urlencode(masked, safe="*")


def redact_url(url: str) -> str:
    """`url` with its password and secret query values masked; anything unparseable is masked whole."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    if not parts.scheme or not parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=_redact_netloc(parts.netloc), query=_redact_query(parts.query)))


def redact_text(text: str) -> str:
    """`text` with every URL in it passed through `redact_url`."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


NO_LOCAL_CHECKPOINT = (
    "no checkpoint at this path on the conversion server (expected a directory holding config.json "
    "and *.safetensors files, or a .gguf file); check the path, or upload the checkpoint and use "
    "s3://bucket/prefix"
)
ELIDED_PATH = "<server path>"
# An absolute path in a message: a '/' that does not continue a word, URL or relative path.
_ABS_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"]*")
_TRAILING_PUNCTUATION = ".,:;)]}"


def is_local(source: str) -> bool:
    return not source.startswith("s3://")


def local_source_problem(source: str) -> str | None:
    """The one message for a server-local source that is not a readable checkpoint directory, whether
    the path is missing, a file, unreadable, a directory without config.json or whose config.json
    is a symlink out of it: an error must not tell the submitter which (that would map the server's
    filesystem)."""
    try:
        path = Path(source).resolve()
        if source.endswith(".gguf"):
            wanted = [resolve_inside(path.parent, path.name)]
        else:
            wanted = [resolve_inside(path, "config.json"), *sorted(path.glob("*.gguf"))[:1]]
        found = any(f.is_file() and os.access(f, os.R_OK) for f in wanted)
    except (OSError, ValueError, RuntimeError, StorageError):
        found = False
    return None if found else f"source {source!r}: {NO_LOCAL_CHECKPOINT}"


def _resolved(source: str) -> str:
    try:
        return os.path.realpath(source)
    except (OSError, ValueError):
        return source


def public_error(message: str, source: str) -> str:
    """An error about `source` as its submitter reads it: credentials in URLs redacted and, for a
    server-local source, no server path but the one submitted. The resolved form of the source
    (`/proc/self/cwd` -> the server's working directory) is written as submitted; any other path is
    elided."""
    message = redact_text(message)
    if not is_local(source):
        return message
    submitted = source.rstrip("/") or "/"
    resolved = _resolved(submitted)

    def rewrite(m: re.Match[str]) -> str:
        path = m.group(0).rstrip(_TRAILING_PUNCTUATION)
        tail = m.group(0)[len(path) :]
        for root in (submitted, resolved):
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return submitted + path[len(root) :] + tail if root != "/" else path + tail
        return ELIDED_PATH + tail

    return _ABS_PATH.sub(rewrite, message)
