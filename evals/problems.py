"""A problem (id, problem text, gold answer), the error bad data raises, and the rows of a loaded table turned into
problems: the problem, answer and id fields resolved against the columns (a column or a dotted path into a nested
one: `evals.fields`), every row's values checked where they are read (present, not empty, the right type) and the
ids checked unique. Every failure is a `DatasetError` naming the table (file or hub id), the row (with its line
number when known), the field and the fix. `evals.datasets` loads the tables (hub, local files, generated tasks)
and calls these; this module does not import `datasets` (the trainer imports `Problem` from here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from miles_k3.evals.fields import MISSING, FieldPath, follow, parse_path, path_failure, show

_BATCH = 1024
"""Rows decoded per batch when rows become problems (one decode per row is several times slower)."""


@dataclass(frozen=True)
class Problem:
    """One problem: a unique `id`, the `problem` text and the gold `answer` as a string in its data form."""

    id: str
    problem: str
    answer: str


class DatasetError(ValueError):
    """The data cannot be used: the message names the file or hub id, the row and field, and the fix."""


@dataclass
class Table:
    """A loaded dataset (`ds`, a `datasets.Dataset`) and how to name its rows in messages (`label`: the file or
    hub id). `raw` and `lines`: the JSON rows as parsed by us (to tell a missing key from a null) and their line
    numbers (None where unknown)."""

    label: str
    ds: Any
    raw: list[dict] | None = None
    lines: list[int | None] | None = None

    def row(self, i: int) -> str:
        """"row i", with its line number when known: "row 3 (line 5)"."""
        line = self.lines[i] if self.lines is not None else None
        return f"row {i}" + (f" (line {line})" if line is not None else "")

    def where(self, i: int) -> str:
        return f"{self.label} {self.row(i)}"


def resolve_fields(table: Table, problem_field: str | None, answer_field: str, id_field: str | None
                   ) -> tuple[FieldPath, FieldPath, FieldPath | None]:
    """The problem, answer and id fields (data.problem_field, data.answer_field, data.id_field; id None: row
    indexes), each checked to start at a column."""
    cols = list(table.ds.column_names)
    problem = problem_field or ("problem" if "problem" in cols else "question")
    id_field = id_field or ("id" if "id" in cols else None)
    fields = []
    for option, name in (("problem_field", problem), ("answer_field", answer_field), ("id_field", id_field)):
        if name is None:
            fields.append(None)
            continue
        column, steps = parse_path(name, name in cols)
        if column not in cols:
            if option == "problem_field" and not problem_field:
                hint = "no 'problem' or 'question' column; "
            elif steps:
                hint = f"no column {column!r} (where the path {name!r} starts); "
            else:
                hint = f"no column {name!r}; "
            tail = " (or a path into it: column.key.0)" if steps else ""
            raise DatasetError(f"{table.label}: {hint}the columns are {', '.join(cols)}; set data.{option}= "
                               f"to the column that holds it{tail}")
        if any(not key for key, _ in steps):
            raise DatasetError(f"{table.label}: data.{option} {name!r} has an empty segment; write the "
                               "column, then each key or item number, one dot apart: prompt.0.content")
        fields.append(FieldPath(option, name, column, steps))
    return fields[0], fields[1], fields[2]


def rows_to_problems(table: Table, problem_f: FieldPath, answer_f: FieldPath,
                     id_f: FieldPath | None) -> list[Problem]:
    """Every row of `table` as a Problem (in row order), each field checked where it is read."""
    fields = [f for f in (problem_f, answer_f, id_f) if f is not None]
    ds = table.ds.select_columns(list(dict.fromkeys(f.column for f in fields)))
    problems = []
    start = 0
    for batch in ds.iter(batch_size=_BATCH):
        problem_col, answer_col = batch[problem_f.column], batch[answer_f.column]
        id_col = batch[id_f.column] if id_f is not None else None
        for j in range(len(problem_col)):
            i = start + j
            if table.raw is not None:
                for f in fields:
                    _check_present(table, i, f.column, f.option)
            problem = _at_path(table, i, problem_f, problem_col[j])
            answer = _at_path(table, i, answer_f, answer_col[j])
            id_value = _at_path(table, i, id_f, id_col[j]) if id_f is not None else None
            problems.append(Problem(id=_id_text(table, i, id_f.path if id_f else None, id_value),
                                    problem=_problem_text(table, i, problem_f.path, problem),
                                    answer=_answer_text(table, i, answer_f.path, answer)))
        start += len(problem_col)
    return problems


def _at_path(table: Table, i: int, field: FieldPath, value: Any) -> Any:
    """The value of row i's field: `value` (its column's) followed along the field's path. A path that does
    not resolve is a DatasetError naming the step; a JSON row is followed as we parsed it where datasets
    gives null or no value (it fills keys missing from a row with null)."""
    if not field.steps:
        return value
    found = follow(value, field.steps)
    if found is None or found is MISSING:
        failure = path_failure(table.raw[i].get(field.column), field) if table.raw is not None else None
        if failure is None and found is MISSING:
            failure = path_failure(value, field)
        if failure is not None:
            raise DatasetError(f"{table.where(i)}: data.{field.option} {field.path!r}: {failure}; fix or "
                               f"drop the row, or set data.{field.option}= to a path that every row has")
    return found


def _check_present(table: Table, i: int, name: str, option: str) -> None:
    """A JSON row without the key at all (datasets fills it with null): say so, listing the keys it has."""
    if table.raw is not None and name not in table.raw[i]:
        raise DatasetError(f"{table.where(i)}: missing field {name!r} (fields present: "
                           f"{', '.join(table.raw[i]) or 'none'}); add it, or set data.{option}= to the field "
                           "that holds it")


def _problem_text(table: Table, i: int, name: str, value: Any) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the problem) is {_emptiness(value)}; every row "
                           "needs the problem text: fill it in or drop the row")
    if not isinstance(value, str):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the problem) must be text, got "
                           f"{type(value).__name__} {show(value)}; set data.problem_field= to the text column")
    return value


def _answer_text(table: Table, i: int, name: str, value: Any) -> str:
    """The gold answer as a string in its data form: strings as they are, numbers as str() (33 -> "33")."""
    if value is None or (isinstance(value, str) and not value.strip()) or _is_nan(value):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the gold answer) is {_emptiness(value)}; every "
                           "row needs a gold answer: fill it in or drop the row")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the gold answer) must be a string or a number, "
                           f"got {type(value).__name__} {show(value)}; set data.answer_field= to the answer column")
    return value if isinstance(value, str) else str(value)


def _id_text(table: Table, i: int, name: str | None, value: Any) -> str:
    if name is None:
        return str(i)
    if value is None or (isinstance(value, str) and not value.strip()) or _is_nan(value):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the id) is {_emptiness(value)}; give every row "
                           "an id, or unset data.id_field and drop the 'id' column to number rows from 0")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DatasetError(f"{table.where(i)}: field {name!r} (the id) must be a string or a number, got "
                           f"{type(value).__name__} {show(value)}; set data.id_field= to an id column")
    return str(value)


def check_unique_ids(table: Table, problems: list[Problem], id_f: str | None) -> None:
    """Every problem id is unique; a duplicate is named with both of its rows."""
    seen: dict[str, int] = {}
    for i, p in enumerate(problems):
        if p.id in seen:
            raise DatasetError(f"{table.label}: duplicate id {p.id!r} in {table.row(seen[p.id])} and "
                               f"{table.row(i)} (field {id_f!r}); ids must be unique: fix the data, or set "
                               "data.id_field= to a unique column")
        seen[p.id] = i


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _emptiness(value: Any) -> str:
    return "null" if value is None else "NaN" if _is_nan(value) else "empty"
