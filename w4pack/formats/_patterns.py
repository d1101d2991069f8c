"""Regular expressions that checkpoint configs carry (compressed-tensors' ``re:`` targets, GPTQModel's ``dynamic``
rules): checked for catastrophic backtracking before any module name is matched.

Python's engine backtracks: ``(.*.*)*!`` takes minutes against one 30-character module name, so a few bytes of a
hostile config.json would hang every command. Such a pattern is refused by name instead. The patterns the quantizers
write (``.*lm_head``, ``.*self_attn.(q|k|v)_proj$``, ``model.layers.[0-9]+.mlp.*``) pass.
"""
from __future__ import annotations

from typing import Any

try:  # the parser behind re.compile (re._parser since Python 3.11, sre_parse before)
    from re import _constants as _sre_constants  # type: ignore[attr-defined]
    from re import _parser as _sre_parser  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python < 3.11
    import sre_constants as _sre_constants  # type: ignore[no-redef]
    import sre_parse as _sre_parser  # type: ignore[no-redef]

__all__ = ["backtracking", "MAX_UNBOUNDED_REPEATS"]

_REPEATS = {_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT} | (
    {_sre_constants.POSSESSIVE_REPEAT} if hasattr(_sre_constants, "POSSESSIVE_REPEAT") else set())
#: unbounded repetitions a pattern may hold: ".*" k times backtracks over n^k splits of an n-character name
MAX_UNBOUNDED_REPEATS = 3


def backtracking(pattern: str) -> str | None:
    """Why ``pattern`` (one that compiles) may backtrack catastrophically, or None: a repetition or alternatives
    inside a repetition (``(a+)+``, ``(ab|a.)*``: exponential in the name's length), or more than
    MAX_UNBOUNDED_REPEATS unbounded repetitions (polynomial of that degree). Single-character alternatives
    (``(q|k|v)``) are a character class to the parser, not alternatives."""
    unbounded = 0
    stack: list[tuple[Any, bool]] = [(_sre_parser.parse(pattern), False)]
    while stack:
        parsed, in_repeat = stack.pop()
        for op, av in parsed:
            if op in _REPEATS:
                _lo, hi, sub = av
                if in_repeat and hi > 1:
                    return "nests a repetition inside a repetition"
                unbounded += hi == _sre_constants.MAXREPEAT
                stack.append((sub, in_repeat or hi > 1))
            elif op is _sre_constants.BRANCH:
                if in_repeat:
                    return "repeats a choice of alternatives"
                stack.extend((b, in_repeat) for b in av[1])
            elif op is _sre_constants.SUBPATTERN:
                stack.append((av[-1], in_repeat))
            elif op in (_sre_constants.ASSERT, _sre_constants.ASSERT_NOT):
                stack.append((av[1], in_repeat))
            elif op is getattr(_sre_constants, "ATOMIC_GROUP", None):
                stack.append((av, in_repeat))
            elif op is _sre_constants.GROUPREF_EXISTS:
                stack.extend((b, in_repeat) for b in av[1:] if b is not None)
    if unbounded > MAX_UNBOUNDED_REPEATS:
        return f"has {unbounded} unbounded repetitions (at most {MAX_UNBOUNDED_REPEATS})"
    return None
