"""A pydantic ``ValidationError`` in one line: each field and what is wrong with it.

pydantic's own text runs to dozens of lines for one bad file, with documentation
links and the input echoed back; a person at a terminal needs the field, the
reason and the value they gave (the CLI, ``load_plan``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

_SHOWN = 2  # errors spelled out; the rest are counted
_SHORT_INPUT = 40  # characters of a scalar input worth repeating


def _input(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return ""
    text = repr(value)
    return f" (got {text})" if len(text) <= _SHORT_INPUT else ""


def validation_message(exc: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """``field: reason (got value)`` for the first errors, and how many more there are.

    ``names`` renames a top-level field to what the user wrote (a flag, a variable).
    """
    names = names or {}
    errors = exc.errors(include_url=False)
    parts = []
    for err in errors[:_SHOWN]:
        loc = [str(p) for p in err["loc"]]
        if loc:
            loc[0] = names.get(loc[0], loc[0])
        reason = str(err["msg"]).removeprefix("Value error, ")
        got = _input(err.get("input")) if loc else ""
        parts.append(f"{'.'.join(loc)}: {reason}{got}" if loc else reason)
    more = f" (and {len(errors) - _SHOWN} more)" if len(errors) > _SHOWN else ""
    return "; ".join(parts) + more
