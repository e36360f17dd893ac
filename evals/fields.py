"""Field paths: a dataset field option naming a column, or a dotted path into a nested one.

`prompt.0.content` is key `content` of item 0 of the list in column `prompt` (verl-format data): `parse_path`
splits an option into its column and the steps after it, `follow` walks one row's value cheaply (MISSING where a
step does not resolve), and `path_failure` says which step failed and what was there, for the error message.
`evals.problems` maps dataset columns with these (`evals.datasets` checks JSON files' column types with them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHOWN = 60
"""Characters of a value shown in an error message."""
MISSING = object()
"""What `follow` returns where a field path does not resolve."""


Steps = tuple[tuple[str, int | None], ...]
"""The segments after the column: (the segment, its value as a list item number or None)."""


@dataclass(frozen=True)
class FieldPath:
    """A field option resolved against the columns: its `column` and the `steps` that follow it into nested
    values (none for a plain column); `option` ("answer_field") and `path` (its text) name it in messages."""

    option: str
    path: str
    column: str
    steps: Steps


def parse_path(name: str, is_column: bool) -> tuple[str, Steps]:
    """(column, steps) of a field option: the whole name when it is a column (or has no dot), else the first
    segment, then the rest as object keys / list item numbers (non-negative integers)."""
    if is_column or "." not in name:
        return name, ()
    column, *rest = name.split(".")
    return column, tuple((s, int(s) if s.isascii() and s.isdigit() else None) for s in rest)


def follow(value: Any, steps: Steps) -> Any:
    """The value at `steps` inside `value`, or MISSING where a step does not resolve (`path_failure` says
    why)."""
    for key, index in steps:
        if isinstance(value, dict):
            value = value.get(key, MISSING)
            if value is MISSING:
                return MISSING
        elif isinstance(value, (list, tuple)) and index is not None and index < len(value):
            value = value[index]
        else:
            return MISSING
    return value


def path_failure(value: Any, field: FieldPath) -> str | None:
    """Why `field.steps` do not resolve in `value` (the column's value): the step and what was there; None if
    they do."""
    where = field.column
    for key, index in field.steps:
        if isinstance(value, dict):
            if key not in value:
                keys = ", ".join(map(str, value)) or "none"
                keys = keys if len(keys) <= SHOWN else keys[:SHOWN] + "..."
                return f"{where!r} has no key {key!r} (keys: {keys})"
            value = value[key]
        elif isinstance(value, (list, tuple)):
            items = f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
            if index is None:
                return f"{where!r} is {items}, and {key!r} is not an item number (0, 1, ...)"
            if index >= len(value):
                return f"{where!r} is {items}, no item {index}"
            value = value[index]
        else:
            shown = "" if value is None else f" ({show(value)})"
            return (f"{where!r} is {kind_name(value)}, not a list or object, so {key!r} cannot index "
                    f"it{shown}")
        where = f"{where}.{key}"
    return None


def kind_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else f"a {type(value).__name__}"


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."
