"""Who a bearer token is, remembered for a moment: a busy API does not read `api_tokens` on every
request. A revoked token stops working within `token_cache_s` (KILN_TOKEN_CACHE_S; 0 disables)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    """The token a request presented, as the routes need it."""

    id: int
    name: str
    is_admin: bool
    source_buckets: tuple[str, ...] | None = None  # narrows KILN_SOURCE_BUCKETS (services/sources.py)


class TokenCache:
    """Valid tokens by sha256 digest, each kept `ttl_s` seconds from its lookup. Invalid tokens are
    never kept (a token created a moment ago works at once). Bounded: when full, it starts over."""

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Caller]] = {}

    def get(self, digest: str) -> Caller | None:
        entry = self._entries.get(digest)
        if entry is None or time.monotonic() >= entry[0]:
            return None
        return entry[1]

    def put(self, digest: str, caller: Caller) -> None:
        if self.ttl_s <= 0:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[digest] = (time.monotonic() + self.ttl_s, caller)
