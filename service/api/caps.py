"""The graph caps: how many nodes, values and value references a request may carry.

A graph over the caps is refused before anything costly. ``check_counts`` reads them
from the raw body, the moment it has arrived and before authentication, hashing or
parsing (``BodyDecodingMiddleware``): a 51 MiB body of 600k nodes costs what reading
it costs. ``check_parsed_size`` is the exact check on the parsed JSON, before
validation, for a body the scan could not read.
"""

from __future__ import annotations

import functools
import json
import re

from optiremat.service.api.problems import HTTPProblem
from optiremat.service.core.config import Settings
from optiremat.solver.graph import CostGraph
from optiremat.solver.wire import GRAPH_TOO_LARGE

# The graph's columns that hold one entry per node or per value, or a value id per use
# (the edges), and the setting that caps each: (columns, what their entries are,
# setting, its variable, entries beyond the count). A column longer than its cap is
# either over the cap or invalid, so every one of them can be refused before validation.
_CAPPED = (
    (tuple(f for f in CostGraph.model_fields if f.startswith("node_")),
     "nodes", "max_graph_nodes", "OPTIREMAT_MAX_GRAPH_NODES", 0),
    (("input_ptr", "output_ptr"), "nodes", "max_graph_nodes", "OPTIREMAT_MAX_GRAPH_NODES", 1),
    (tuple(f for f in CostGraph.model_fields if f.startswith("value_")),
     "values", "max_graph_values", "OPTIREMAT_MAX_GRAPH_VALUES", 0),
    (("input_ids", "output_ids", "inputs", "backward_reads", "carry_in", "carry_out"),
     "value references", "max_graph_edges", "OPTIREMAT_MAX_GRAPH_EDGES", 0),
)
CAP_OF = {column: (what, setting, variable, extra)
          for columns, what, setting, variable, extra in _CAPPED for column in columns}


def too_large(column: str, entries: int, settings: Settings,
              at_least: bool = False) -> HTTPProblem | None:
    what, setting, variable, extra = CAP_OF[column]
    cap: int = getattr(settings, setting)
    if entries - extra <= cap:
        return None
    of = "" if column in ("node_id", "value_id") else f" ({column} has {entries} entries)"
    return HTTPProblem.of(
        GRAPH_TOO_LARGE, 413,
        f"the graph has {'at least ' if at_least else ''}{entries - extra} {what}{of}; this "
        f"server accepts at most {cap} ({variable})")


def check_parsed_size(data: object, settings: Settings) -> None:
    """The exact check, on the parsed JSON before validation: every capped column."""
    graph = data.get("graph") if isinstance(data, dict) else None
    if not isinstance(graph, dict):
        return
    for column in CAP_OF:
        entries = graph.get(column)
        if isinstance(entries, list):
            problem = too_large(column, len(entries), settings)
            if problem is not None:
                raise problem


# Where an array follows a colon: a key's array, or bytes inside a string. Searching
# for the colon is memchr-fast; the key is then read backwards and decoded as JSON.
_ARRAY_AFTER_KEY = re.compile(rb":[ \t\r\n]*\[")
_LONGEST_KEY = 6 * max(map(len, CAP_OF))  # every character escaped as \uXXXX
# Colons followed by "[" inside strings cost a step each: past this many, the scan stops
# and the exact check after the parse decides (a legit graph has about 20).
_MOST_ARRAYS = 10_000
# One array entry: a string, a number or literal, or an array of those without strings
# (value_shape's). Atomic, so a failed match never backtracks into an entry.
_ENTRY = rb'(?>"(?:[^"\\]|\\.)*+"|[^\s,\[\]{}"]++|\[[^\[\]{}"]*+\])'
_EMPTY = re.compile(rb"\s*\]")


def _escaped(raw: bytes, quote: int) -> bool:
    """Whether the quote at ``quote`` is escaped: an odd run of backslashes before it."""
    run = 0
    while quote - run - 1 >= 0 and raw[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 1


def _key_before(raw: bytes, colon: int) -> str | None:
    """The decoded key whose colon is at ``colon``, if a capped column's could be there.

    Its closing quote is the last byte before the colon but whitespace, and not escaped;
    its opening quote the first unescaped one before that (inside a JSON string every
    quote is escaped). A colon inside a string yields no key or a key that is no column.
    """
    close = colon - 1
    while close >= 0 and raw[close] in b" \t\r\n":
        close -= 1
    if close < 0 or raw[close] != 0x22 or _escaped(raw, close):
        return None
    start = raw.rfind(b'"', max(0, close - _LONGEST_KEY - 1), close)
    while start >= 0 and _escaped(raw, start):
        start = raw.rfind(b'"', max(0, close - _LONGEST_KEY - 1), start)
    if start < 0:
        return None
    key = raw[start:close + 1]
    if b"\\" not in key:
        return key[1:-1].decode("latin-1")
    try:
        decoded = json.loads(key)  # "node\u005fid" is node_id
    except ValueError:
        return None
    return decoded if isinstance(decoded, str) else None


@functools.lru_cache(maxsize=8)
def _more_than(entries: int) -> re.Pattern[bytes]:
    """Matches an array's opening bracket only when more than ``entries`` entries follow."""
    return re.compile(rb"\s*" + _ENTRY + rb"(?:\s*,\s*" + _ENTRY + rb"){%d}" % entries)


def _longer_than(raw: bytes, start: int, entries: int) -> int | None:
    """How many entries the array whose first entry may start at ``start`` holds, if more
    than ``entries``; None if not, or if it cannot tell without parsing.

    An array of numbers counts as its commas and one, read at memchr speed. One with
    strings or inner arrays (whose commas are not its own) is matched entry by entry
    by a regex, up to one entry past the cap.
    """
    end = raw.find(b"]", start)
    end = len(raw) if end < 0 else end
    if raw.find(b'"', start, end) < 0 and raw.find(b"[", start, end) < 0:
        count = 0 if _EMPTY.match(raw, start) else raw.count(b",", start, end) + 1
        return count if count > entries else None
    if _more_than(entries).match(raw, start):
        return entries + 1
    return None


def check_counts(raw: bytes, settings: Settings) -> None:
    """Refuse a graph over the node or value caps before parsing it: a 40 MiB body of
    600k nodes took 6 s of CPU to validate and 0.4 s just to parse, and this scan takes
    milliseconds. It reads keys as JSON does (escapes decoded), and every column that
    holds an entry per node or per value. A body it cannot read this way still meets
    ``check_parsed_size`` after the parse, before validation."""
    for seen, match in enumerate(_ARRAY_AFTER_KEY.finditer(raw)):
        if seen >= _MOST_ARRAYS:
            return
        column = _key_before(raw, match.start())
        if column not in CAP_OF:
            continue
        setting, extra = CAP_OF[column][1], CAP_OF[column][3]
        entries = _longer_than(raw, match.end(), getattr(settings, setting) + extra)
        if entries is not None:
            problem = too_large(column, entries, settings, at_least=True)
            if problem is not None:
                raise problem


