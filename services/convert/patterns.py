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
from typing import Any, Protocol

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


class Program(Protocol):
    """A compiled RE2 program (re2.compile's result; google-re2 has no public type for it)."""

    def match(self, text: str) -> Any: ...


def _options(max_mem: int) -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # the error is raised to the caller, not logged by RE2
    options.max_mem = max_mem
    return options


def _reason(e: re2.error) -> str:
    return e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)


class PatternCompiler:
    """Checks and compiles the patterns of one quantization config, counting them against the cap
    (`count`, which planning also weighs against the number of modules: MAX_PATTERN_MATCHES).

    Each field's patterns also become one RE2 program (an alternation), so a module name no pattern
    matches costs one match whatever the number of patterns."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.count = 0

    def check(self, pattern: str, field: str) -> str:
        """`pattern` from config field `field` (named with its entry in errors), if RE2 can run it."""
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
            re2.compile(pattern, _options(PATTERN_MAX_MEM))
        except re2.error as e:
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: {pattern!r} is not a regular expression Kiln "
                f"can use ({_reason(e)}). {RE2_SYNTAX}"
            ) from e
        return pattern

    def _program(self, alternatives: list[str], field: str) -> Program:
        try:
            return re2.compile("|".join(alternatives), _options(PATTERN_MAX_MEM * 4))
        except re2.error as e:
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: its regular expressions together are too large "
                f"for Kiln's matcher ({_reason(e)}); merge or shorten them"
            ) from e

    def first_of(self, patterns: list[tuple[str, str]], field: str) -> FirstMatch:
        """Patterns `(pattern, entry label)` in config order (GPTQ `dynamic`: the first rule wins)."""
        checked = [self.check(pattern, label) for pattern, label in patterns]
        if not checked:
            return FirstMatch(None, ())
        one = tuple(re2.compile(p, _options(PATTERN_MAX_MEM)) for p in checked)
        return FirstMatch(self._program([f"(?:{p})" for p in checked], field), one)

    def names(self, entries: Iterable[object], field: str) -> NameMatcher:
        """compressed-tensors' matching of `ignore` / `targets`: an exact name, or `re:` + a pattern."""
        items = [str(e) for e in entries]
        if len(items) > MAX_CONFIG_ENTRIES:
            raise QuantConfigError(
                f"{self.fmt} quantization config {field}: {len(items)} entries, over Kiln's cap of "
                f"{MAX_CONFIG_ENTRIES} (services/convert/limits.py); use `re:` patterns for long lists"
            )
        exact = frozenset(i for i in items if not i.startswith(REGEX_PREFIX))
        checked = [
            self.check(i.removeprefix(REGEX_PREFIX), f"{field} entry {i!r}")
            for i in dict.fromkeys(items)
            if i.startswith(REGEX_PREFIX)
        ]
        program = self._program([f"(?:{p})" for p in checked], field) if checked else None
        return NameMatcher(exact, program)


class FirstMatch:
    """The index of the first pattern that matches at the start of a name (a loop of re.match): one
    program of all the patterns answers "none" in one pass; a name some pattern matches is then
    tried against each in order."""

    def __init__(self, any_of: Program | None, patterns: tuple[Program, ...]) -> None:
        self.any_of = any_of
        self.patterns = patterns

    def first(self, name: str) -> int | None:
        if self.any_of is None or self.any_of.match(name) is None:
            return None
        return next((i for i, p in enumerate(self.patterns) if p.match(name) is not None), None)


class NameMatcher:
    """Exact names (a set lookup) and RE2 patterns matched at the start of a name (one program)."""

    def __init__(self, exact: frozenset[str], program: Program | None) -> None:
        self.exact = exact
        self.program = program

    def matches(self, name: str) -> bool:
        return name in self.exact or (self.program is not None and self.program.match(name) is not None)
