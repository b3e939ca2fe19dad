"""Regular expressions from a checkpoint's own config: the one place they are compiled and matched.

compressed-tensors `ignore` / `targets` entries prefixed `re:` and GPTQModel `dynamic` rule keys
(`+:` / `-:` / plain) are untrusted input, matched against module names in the API process
(POST /v1/plans) and the worker. Python's `re` backtracks and holds the GIL while it does: one
pattern such as `(?:.*.*)*!` froze every thread of `kiln api` (/health included) and, against a
longer name, never returns. Here they run under RE2 (google-re2), whose matching time is linear in
the name's length for any pattern; what RE2 cannot run in linear time (backreferences, lookaround)
is refused with a QuantConfigError naming the field and the pattern. The semantics are vLLM's
`re.match`: anchored at the start of the name, not at its end.

Limits (services/convert/limits.py): at most MAX_CONFIG_PATTERNS patterns per quantization config,
MAX_PATTERN_CHARS characters each, PATTERN_MAX_MEM bytes of RE2 program each, and at most
MAX_CONFIG_ENTRIES names in one list field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import re2

from services.convert.errors import QuantConfigError
from services.convert.limits import (
    MAX_CONFIG_ENTRIES,
    MAX_CONFIG_PATTERNS,
    MAX_PATTERN_CHARS,
    PATTERN_MAX_MEM,
)

REGEX_PREFIX = "re:"  # compressed-tensors: an entry that is a regular expression
RE2_SYNTAX = (
    "Kiln matches a checkpoint's patterns with RE2 (linear time): no backreferences or lookaround, "
    r"and \z instead of Python's \Z; rewrite the pattern without them"
)


class CompiledPattern(Protocol):
    def match(self, text: str) -> object | None: ...


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # the error is raised to the caller, not logged by RE2
    options.max_mem = PATTERN_MAX_MEM
    return options


class PatternCompiler:
    """Compiles the patterns of one quantization config, counting them against the per-config cap."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.count = 0

    def compile(self, pattern: str, field: str) -> CompiledPattern:
        """`pattern` from config field `field` (named with its entry in errors), compiled for RE2."""
        self.count += 1
        if self.count > MAX_CONFIG_PATTERNS:
            raise QuantConfigError(
                f"{self.fmt} quantization config: more than {MAX_CONFIG_PATTERNS} regular expressions "
                f"(at {field}); Kiln caps them (services/convert/limits.py): merge the patterns"
            )
        if len(pattern) > MAX_PATTERN_CHARS:
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: the regular expression is {len(pattern)} "
                f"characters, over Kiln's cap of {MAX_PATTERN_CHARS}; shorten it"
            )
        try:
            return re2.compile(pattern, _options())
        except re2.error as e:
            reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else e
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: {pattern!r} is not a regular expression Kiln "
                f"can use ({reason}). {RE2_SYNTAX}"
            ) from e

    def names(self, entries: Iterable[object], field: str) -> NameMatcher:
        """compressed-tensors' matching of `ignore` / `targets`: an exact name, or `re:` + a pattern."""
        items = [str(e) for e in entries]
        if len(items) > MAX_CONFIG_ENTRIES:
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: {len(items)} entries, over Kiln's cap of "
                f"{MAX_CONFIG_ENTRIES} (services/convert/limits.py); use `re:` patterns for long lists"
            )
        exact = frozenset(i for i in items if not i.startswith(REGEX_PREFIX))
        patterns = tuple(
            self.compile(i.removeprefix(REGEX_PREFIX), f"{field} entry {i!r}")
            for i in dict.fromkeys(items)
            if i.startswith(REGEX_PREFIX)
        )
        return NameMatcher(exact, patterns)


class NameMatcher:
    """Exact names (a set lookup) and RE2 patterns matched at the start of a name."""

    def __init__(self, exact: frozenset[str], patterns: tuple[CompiledPattern, ...]) -> None:
        self.exact = exact
        self.patterns = patterns

    def matches(self, name: str) -> bool:
        return name in self.exact or any(p.match(name) is not None for p in self.patterns)
