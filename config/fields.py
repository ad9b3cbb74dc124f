"""Field helpers shared by every config class: human-readable integers and
attribute docstrings (the text under each field, which becomes `--help`)."""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from decimal import Decimal
from typing import Annotated


class HumanReadable:
    """Marker: an int field that accepts `1k` (1000) and `1K` (1024) on the CLI."""


HumanInt = Annotated[int, HumanReadable]
"""A token count or a byte count: `25.6k`, `2M` and `1G` are accepted."""

RESOLVED = {"resolved": True}
"""Field metadata: set by resolution, not by the user (no CLI flag)."""

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*$")


def parse_human_int(text: str) -> int:
    """`1k` -> 1000, `1K` -> 1024, `2.5m` -> 2500000, `7` -> 7.

    Lower-case suffixes are decimal, upper-case ones binary. A value that is
    not a whole number after scaling is refused rather than rounded.
    """
    match = _HUMAN_INT.match(str(text))
    if match is None:
        raise ValueError(f"{text!r} is not a number like 512, 1k (1000), 1K (1024), 2M or 1G")
    number, suffix = match.groups()
    scale = _DECIMAL.get(suffix) or _BINARY.get(suffix) or 1
    value = Decimal(number) * scale
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


_BARE_HUMAN_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[kmgtKMGT]\b")


def expand_human_numbers_in_json(text: str) -> str:
    """Replace bare `80m`-style tokens in a JSON text by their integer value;
    strings in quotes are left alone."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    for i in range(0, len(parts), 2):  # even parts lie outside quoted strings
        parts[i] = _BARE_HUMAN_NUMBER.sub(lambda m: str(parse_human_int(m.group())), parts[i])
    return "".join(parts)


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Map each field of `cls` (and its bases) to the docstring written under it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        class_def = ast.parse(source).body[0]
        body = getattr(class_def, "body", [])
        for stmt, following in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs
