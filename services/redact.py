"""Credential redaction for every URL the services log or show (broker, database, S3 endpoint).

`redact_url` masks the password of one URL (`redis://:***@host:6379/0`) and the values of
secret-looking query parameters; `redact_text` does the same to every URL inside free text such as
an exception message. Both leave text without credentials unchanged.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
