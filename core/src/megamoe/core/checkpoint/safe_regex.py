r"""Whether a regular expression from an untrusted file can run long: checked before it runs.

Python's ``re`` backtracks. A repeat of something that can match in several ways (``(a+)*``,
``(a|b)*``) tries exponentially many splits of a string it does not match, and k unbounded
repeats that can match the same characters (``.*.*.*``) n^k; a checkpoint's
``quantization_config`` patterns (compressed-tensors' ``re:`` entries) run against every
module name of every layer, so one such pattern hangs every command that opens the
checkpoint. :func:`regex_problem` parses a pattern (CPython's own parser, ``re._parser``,
3.11 on; without it every pattern is refused) and says what could run long, if anything:

- a repeated group that varies in length or holds alternatives;
- two unbounded repeats with no literal character between them (a literal leaves them few
  places to split: module names hold few of each character);
- more than ``MAX_UNBOUNDED_REPEATS`` unbounded repeats, or more than ``MAX_REGEX_CHOICES``
  repeats and alternations in all (``a?`` thirty times is exponential with no nesting);
- a backreference, a construct it does not know, or more than ``MAX_PATTERN_CHARS``
  characters.

Real patterns pass: ``.*lm_head``, ``model\.layers\.\d+\.mlp\.gate$``,
``.*(q_proj|k_proj|v_proj)$``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

try:  # CPython's regex parser (3.11+), to check a pattern before running it
    _sre_parser: Any = importlib.import_module("re._parser")
    _sre: Any = importlib.import_module("re._constants")
except ImportError:  # pragma: no cover - then every pattern is refused (fail closed)
    _sre_parser = _sre = None

__all__ = ["MAX_PATTERN_CHARS", "SAFE_RULE", "regex_problem"]

MAX_PATTERN_CHARS = 512  # longest pattern
MAX_UNBOUNDED_REPEATS = 4  # repeats of more than two lengths (*, +, {1,9}) in one pattern
MAX_REGEX_CHOICES = 8  # repeats of varying length (also ?) and alternations in one pattern
SAFE_RULE = (
    f"at most {MAX_PATTERN_CHARS} characters, no repeated group that varies in length or holds "
    f"alternatives, at most {MAX_UNBOUNDED_REPEATS} unbounded repeats with a literal character "
    f"between any two, at most {MAX_REGEX_CHOICES} repeats and alternations in all, no "
    "backreference"
)


def regex_problem(body: str) -> str | None:
    """Why matching the regular expression ``body`` could take long; None when it cannot.

    The rules are the module docstring's (``SAFE_RULE`` in a sentence).
    """
    if len(body) > MAX_PATTERN_CHARS:
        return f"it is {len(body)} characters long, over {MAX_PATTERN_CHARS}"
    if _sre_parser is None:  # pragma: no cover
        return "this Python has no re._parser to check the pattern with"
    try:
        items = _sre_parser.parse(body)
    except re.error as err:
        return f"it is not a valid regular expression ({err})"
    except RecursionError:
        return "it nests groups too deeply"
    counts = {"unbounded": 0, "choices": 0}
    try:
        _scan_regex(items, False, counts)
    except _UnsafeRegexError as err:
        return str(err)
    if counts["unbounded"] > MAX_UNBOUNDED_REPEATS:
        return f"it has {counts['unbounded']} unbounded repeats, over {MAX_UNBOUNDED_REPEATS}"
    if counts["choices"] > MAX_REGEX_CHOICES:
        return f"it has {counts['choices']} repeats and alternations, over {MAX_REGEX_CHOICES}"
    return None


class _UnsafeRegexError(Exception):
    """A construct of a pattern ``_regex_problem`` refuses (the message says which)."""


def _scan_regex(items: Any, pending: bool, counts: dict[str, int]) -> bool:
    """Walk parsed ``items``, counting repeats and alternations; raise on an unsafe one.

    ``pending``: an unbounded repeat came before with no literal character since. Returns
    the same after ``items``.
    """
    for op, av in items:
        if op is _sre.LITERAL:
            pending = False
        elif op in (_sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT):
            pass  # one character of a class, or an anchor
        elif op is _sre.SUBPATTERN:
            pending = _scan_regex(av[3], pending, counts)
        elif op is _sre.ATOMIC_GROUP:
            pending = _scan_regex(av, pending, counts)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            _scan_regex(av[1], False, counts)  # zero width: leaves ``pending`` as it was
        elif op is _sre.BRANCH:
            counts["choices"] += 1
            pending = any([_scan_regex(alt, pending, counts) for alt in av[1]])
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            low, high, body = av
            if high > 1 and _varies(body):
                raise _UnsafeRegexError(
                    "it repeats a group that itself varies in length or holds alternatives "
                    "(like (a+)* or (a|b)*), which backtracks exponentially"
                )
            if high == low:
                pending = _scan_regex(body, pending, counts) if high else pending
                continue
            counts["choices"] += 1
            _scan_regex(body, False, counts)
            if high - low > 1:  # unbounded, or bounded but long: as many splits
                if pending:
                    raise _UnsafeRegexError(
                        "two unbounded repeats can match the same characters with no literal "
                        "character between them (like .*.* or .*[a-z]+), which backtracks "
                        "polynomially"
                    )
                counts["unbounded"] += 1
                pending = True
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            raise _UnsafeRegexError("it uses a backreference")
        else:
            raise _UnsafeRegexError(f"it uses {str(op).lower()}, which megamoe does not check")
    return pending


def _varies(items: Any) -> bool:
    """Whether parsed ``items`` can match strings of several lengths or in several ways."""
    for op, av in items:
        if op in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.AT):
            continue
        if op is _sre.SUBPATTERN:
            inner = av[3]
        elif op is _sre.ATOMIC_GROUP:
            inner = av
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            inner = av[1]
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT) and av[0] == av[1]:
            inner = av[2]
        else:
            return True  # a repeat of varying length, an alternation, a backreference
        if _varies(inner):
            return True
    return False
