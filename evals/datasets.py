"""Evaluation and training problems (id, problem text, gold answer) loaded through Hugging Face `datasets`: the
sources (hub, local files, saved datasets, generated tasks) and our scan of JSON files; the rows then become
`Problem`s, checked field by field, in `evals.problems`.

`load_problems(DatasetConfig)` reads a hub dataset (`HuggingFaceH4/aime_2024`, ...), a local `.jsonl`, `.json`
(a list of objects, or JSON Lines) or `.parquet` file, or a directory written by `Dataset.save_to_disk`, and
returns `Problem`s whose answers keep the form they have in the data ("033" stays "033"; graders normalise).
Input is checked where it enters: every failure is a `DatasetError` naming the file (or hub id), the row, the
field and the fix. JSON files are scanned by us before `datasets` reads them, so that a malformed line is named
by its number and a column holding both strings and numbers (which `datasets` would turn into a JSON column,
reading the string "033" back as the number 33) is rejected instead of silently losing the answer's form.
A field option names a column or a dotted path into a nested one: `prompt.0.content` is key `content` of
item 0 of the list in column `prompt` (verl-format data); a column whose own name has the dots is used as is.
Hub datasets users evaluate on are registered as presets (`register_preset`): their split and columns; no
data is shipped. `datasets` is imported inside the functions that need it (GPU hosts may lack it).
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_k3.evals.fields import MISSING, follow, parse_path, show
from miles_k3.evals.guess import GuessSourceError, is_guess
from miles_k3.evals.guess import generate_rows as generate_guess_rows
from miles_k3.evals.problems import (
    DatasetError,
    Problem,
    Table,
    check_unique_ids,
    resolve_fields,
    rows_to_problems,
)
from miles_k3.evals.tasks import TaskError, generate_rows, is_task, task_name
from miles_k3.evals.textfile import numbered_lines, utf8_text
from miles_k3.evals.worked import WorkedSourceError, is_worked
from miles_k3.evals.worked import generate_rows as generate_worked_rows

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local file suffix -> the `datasets` builder that reads it."""
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass
class DatasetConfig:
    """Where the problems come from and which columns hold the problem, the gold answer and the id."""

    source: str = "HuggingFaceH4/aime_2024"
    """A hub dataset id (owner/name), a local .jsonl / .json / .parquet file, a directory saved by `datasets`
    (save_to_disk), reasoning_gym:<generator> (problems generated offline, e.g. reasoning_gym:chain_sum), or
    guess (the guess-the-number problems of env=guess, `evals/guess.py`: task_args min_n, max_n), or worked_sum
    (multi-step sums with worked solutions, `evals/worked.py`: task_args min_terms, max_terms, min_value,
    max_value, form)."""
    split: str | None = None
    """The split to read; None: the preset's split for a known hub id (e.g. "test" for math-ai/aime25), else
    "train". A local file has only the split "train"; a reasoning_gym source has train and test (disjoint)."""
    problem_field: str | None = None
    """The column with the problem text, or a dotted path into a nested column: the column, then object keys
    and list item numbers ("prompt.0.content"; a column named with the dots wins); None: "problem" if the data
    has it, else "question"."""
    answer_field: str = "answer"
    """The column (or dotted path, as for problem_field: "reward_model.ground_truth") with the gold answer (a
    string keeps its form; a number becomes its str(), 33 -> "33")."""
    id_field: str | None = None
    """The column (or dotted path, as for problem_field: "extra_info.index") with a unique problem id; None:
    "id" if the data has it, else the row index ("0", "1", ...)."""
    limit: int | None = None
    """Use only the first `limit` rows (None: all)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub dataset; None: the default branch."""
    size: int = 10000
    """Problems generated for a reasoning_gym source."""
    seed: int = 0
    """The generator's seed for a reasoning_gym source (draw i of a seed is always the same problem)."""
    distinct: bool = True
    """A reasoning_gym source: each problem once (False: the generator's distribution, repeats included; a set of
    distinct problems over-represents the rarer, harder ones)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """The reasoning_gym generator's own parameters, e.g. {min_terms: 2, max_terms: 3, max_digits: 2}."""

    def validate(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"source: must be a hub id (owner/name) or a path to a .jsonl/.json/.parquet file, "
                             f"got {self.source!r}")
        for name in ("split", "problem_field", "id_field", "revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}: must be a non-empty string or None (unset), got {value!r}")
        if not isinstance(self.answer_field, str) or not self.answer_field.strip():
            raise ValueError(f"answer_field: must name the column holding the gold answer, got "
                             f"{self.answer_field!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise ValueError(f"limit: must be >= 1 (or None for all rows), got {self.limit!r}")
        if self.size < 1:
            raise ValueError(f"size: must be >= 1 (problems to generate), got {self.size}")
        if is_task(self.source) and not task_name(self.source).strip():
            raise ValueError("source: name the generator after 'reasoning_gym:', e.g. reasoning_gym:chain_sum")


# ---- hub presets ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HubPreset:
    """A hub dataset we know: the split to read by default and its columns (for messages and tests)."""

    split: str
    columns: tuple[str, ...]


PRESETS: dict[str, HubPreset] = {}


def register_preset(hub_id: str, split: str, columns: tuple[str, ...]) -> None:
    """Make `hub_id` known: DatasetConfig(source=hub_id) reads `split` when no split is set."""
    PRESETS[hub_id] = HubPreset(split, tuple(columns))


register_preset("HuggingFaceH4/aime_2024", "train", ("id", "problem", "solution", "answer", "url", "year"))
register_preset("math-ai/aime25", "test", ("problem", "answer", "id"))
register_preset("AI-MO/aimo-validation-aime", "train", ("id", "problem", "solution", "answer", "url"))
register_preset("BytedTsinghua-SIA/DAPO-Math-17k", "train",
                ("data_source", "prompt", "ability", "reward_model", "extra_info"))


def default_split(source: str) -> str:
    """The split read when DatasetConfig.split is None: the preset's for a known hub id, else "train"."""
    preset = PRESETS.get(source)
    return preset.split if preset is not None else "train"


# ---- loading ----------------------------------------------------------------------------------------------------
def load_problems(cfg: DatasetConfig) -> list[Problem]:
    """The problems of `cfg.source` in data order (the first `cfg.limit` rows when set).

    Rows are counted from 0 in messages (as the ids made from row indexes are). Raises DatasetError for any
    problem with the data, ValueError (from `cfg.validate()`) for a bad config value.
    """
    cfg.validate()
    table = _load_table(cfg)
    if len(table.ds) == 0:
        raise DatasetError(f"{table.label} has no rows; point data.source at a dataset with problems")
    fields = resolve_fields(table, cfg.problem_field, cfg.answer_field, cfg.id_field)
    if cfg.limit is not None and cfg.limit < len(table.ds):
        table.ds = table.ds.select(range(cfg.limit))
    problems = rows_to_problems(table, *fields)
    check_unique_ids(table, problems, fields[2].path if fields[2] is not None else None)
    return problems


def _load_table(cfg: DatasetConfig) -> Table:
    if is_task(cfg.source):
        return _load_task(cfg)
    if is_guess(cfg.source):
        return _load_guess(cfg)
    if is_worked(cfg.source):
        return _load_worked(cfg)
    path = Path(cfg.source).expanduser()
    if path.exists():
        return _load_local(path, cfg)
    if _looks_like_path(cfg.source):
        raise DatasetError(f"data.source: no such file {path} (working directory {Path.cwd()}); fix the path, or "
                           "give a hub id such as HuggingFaceH4/aime_2024")
    return _load_hub(cfg)


def _load_task(cfg: DatasetConfig) -> Table:
    """data.source=reasoning_gym:<name>: a reasoning-gym generator's problems (`evals.tasks`)."""
    return _generated(cfg, cfg.source, TaskError,
                      lambda split: generate_rows(task_name(cfg.source), split, cfg.size, cfg.seed, cfg.task_args,
                                                  cfg.distinct))


def _load_guess(cfg: DatasetConfig) -> Table:
    """data.source=guess: guess-the-number problems (`evals.guess`), train or test split."""
    return _generated(cfg, "guess", GuessSourceError,
                      lambda split: generate_guess_rows(split, cfg.size, cfg.seed, cfg.task_args, cfg.distinct))


def _load_worked(cfg: DatasetConfig) -> Table:
    """data.source=worked_sum: multi-step sums with worked solutions (`evals.worked`), train or test split."""
    return _generated(cfg, "worked_sum", WorkedSourceError,
                      lambda split: generate_worked_rows(split, cfg.size, cfg.seed, cfg.task_args, cfg.distinct))


def _generated(cfg: DatasetConfig, name: str, error: type[Exception], make_rows) -> Table:
    """The table of a generated source: `make_rows(split)` (split: data.split, default train); its own error type
    becomes a DatasetError with the generator's message."""
    import datasets

    split = cfg.split or "train"
    try:
        rows = make_rows(split)
    except error as e:
        raise DatasetError(str(e)) from None
    return Table(f"{name} [{split}, seed {cfg.seed}]", datasets.Dataset.from_list(rows), rows, [None] * len(rows))


def _looks_like_path(source: str) -> bool:
    """A source that cannot be a hub id: a known file suffix, an absolute/relative/home path, or several '/'."""
    return (Path(source).suffix.lower() in LOCAL_FORMATS or source.startswith(("/", ".", "~"))
            or "\\" in source or not _HUB_ID.match(source))


def _load_local(path: Path, cfg: DatasetConfig) -> Table:
    if path.is_dir():
        return _load_saved(path, cfg)
    fmt = path.suffix.lower()
    if fmt not in LOCAL_FORMATS:
        raise DatasetError(f"data.source {path}: unsupported file type '{path.suffix}'; use a .jsonl, .json or "
                           ".parquet file, or a directory written by datasets' save_to_disk")
    if cfg.split not in (None, "train"):
        raise DatasetError(f"data.split={cfg.split!r}: a local file has one split, 'train'; unset data.split "
                           f"(for {path})")
    raw, lines = _scan_json(path, fmt, cfg) if fmt != ".parquet" else _scan_parquet(path)
    ds = _read_file(path, LOCAL_FORMATS[fmt], fmt.lstrip("."))
    if raw is not None and len(raw) != len(ds):
        raw, lines = None, None  # datasets read the rows differently from us: name rows without line numbers
    return Table(str(path), ds, raw, lines)


def _read_file(path: Path, builder: str, kind: str):
    import datasets

    with _quiet_progress():
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as e:  # datasets and pyarrow raise many types; the cause is what the user needs
            raise DatasetError(f"data file {path} could not be read as {kind}: {_cause(e)}") from e


def _load_saved(path: Path, cfg: DatasetConfig) -> Table:
    import datasets

    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        raise DatasetError(f"data.source {path} is a directory but not one written by datasets' save_to_disk "
                           "(no state.json or dataset_dict.json in it); point data.source at a .jsonl, .json "
                           "or .parquet file")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DatasetError(f"data directory {path} could not be read by datasets.load_from_disk: {_cause(e)}") from e
    if not isinstance(loaded, datasets.DatasetDict):
        if cfg.split not in (None, "train"):
            raise DatasetError(f"data.split={cfg.split!r}: {path} holds one dataset, not splits; unset data.split")
        return Table(str(path), loaded)
    split = cfg.split or "train"
    if split not in loaded:
        raise DatasetError(f"data directory {path} has no split {split!r} (splits: {', '.join(loaded)}); set "
                           "data.split to one of them")
    return Table(f"{path} [{split}]", loaded[split])


def _load_hub(cfg: DatasetConfig) -> Table:
    """A hub dataset's split. When the hub cannot be reached (`hub_unreachable`: a probe of a few seconds) it is
    read from the local datasets cache in offline mode, or refused at once: `datasets` would otherwise retry the
    hub for about 30 s before failing."""
    import datasets

    split = cfg.split or default_split(cfg.source)
    rev = f" at revision {cfg.revision!r}" if cfg.revision else ""
    unreachable = None if datasets.config.HF_HUB_OFFLINE else hub_unreachable()
    try:
        with _offline(unreachable is not None):
            ds = datasets.load_dataset(cfg.source, split=split, revision=cfg.revision)
    except Exception as e:
        if isinstance(e, ValueError) and ("Unknown split" in str(e) or "Bad split" in str(e)):
            raise DatasetError(f"data.split: hub dataset {cfg.source!r}{rev} has no split {split!r} ({e}); set "
                               "data.split to one of its splits") from e
        if unreachable is not None:
            raise DatasetError(
                f"data.source: hub dataset {cfg.source!r} split {split!r}{rev} is not in the local datasets cache "
                f"and the Hugging Face hub cannot be reached ({unreachable}); point the source at a local .jsonl, "
                ".json or .parquet file instead (data.source=/path/file.jsonl; for python -m miles_k3.eval, "
                "eval.data.source=/path/file.jsonl)") from None
        raise DatasetError(
            f"data.source: could not load hub dataset {cfg.source!r} split {split!r}{rev}: {_cause(e)}. Reading "
            "it needs network access to the Hugging Face hub (or a copy in the local datasets cache); without "
            "it, copy the data here and use a local copy: data.source=/path/file.jsonl (no local file named "
            f"{cfg.source!r} exists either)") from e
    return Table(f"hub dataset {cfg.source} [{split}]", ds)


HUB_PROBE_TIMEOUT_S = 3.0
"""How long `hub_unreachable` waits for the hub to answer before taking it as unreachable."""


def hub_unreachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub (huggingface_hub's endpoint: HF_ENDPOINT, else https://huggingface.co) cannot be
    reached, from one HEAD request through the environment's proxies, or None when it answers (with any status) or
    fails in a way that is not about reaching it (TLS: a proxy of one's own may need its certificate)."""
    import ssl
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as e:
        reason = e.reason
        return None if isinstance(reason, ssl.SSLError) else f"{constants.ENDPOINT}: {reason}"
    except (TimeoutError, OSError) as e:
        return f"{constants.ENDPOINT}: {e or type(e).__name__}"
    return None


@contextmanager
def _offline(on: bool):
    """`datasets` and huggingface_hub in offline mode (HF_HUB_OFFLINE: the local cache only, no retries) while
    `on`; their previous mode is restored."""
    import datasets
    from huggingface_hub import constants

    before = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    if on:
        datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = before


def _cause(e: BaseException) -> str:
    """The innermost explicit cause's message (datasets wraps pyarrow errors in generic ones)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 500 else text[:500] + "..."


@contextmanager
def _quiet_progress():
    """No "Generating train split" progress bars while a local file is read; the previous state is restored."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _scan_parquet(path: Path) -> tuple[None, None]:
    """Check the file is parquet with rows (datasets fails obscurely on an empty one)."""
    import pyarrow.parquet as pq

    try:
        num_rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DatasetError(f"data file {path} could not be read as parquet: {_cause(e)}") from e
    if num_rows == 0:
        raise DatasetError(f"{path} has no rows; point data.source at a dataset with problems")
    return None, None


# ---- our scan of JSON files ------------------------------------------------------------------------------------
def _scan_json(path: Path, fmt: str, cfg: DatasetConfig) -> tuple[list[dict], list[int | None]]:
    """The rows of a .jsonl / .json file and their line numbers, after checking the file parses, every row is
    an object, and the columns that may be mapped do not mix JSON types. Bad UTF-8 is named by its line."""
    try:
        text = utf8_text(path, DatasetError)
    except OSError as e:
        raise DatasetError(f"data file {path} could not be read as {fmt.lstrip('.')}: {e}") from e
    if fmt == ".json" and text.lstrip().startswith("["):
        rows, lines = _scan_json_list(path, text), None
    elif fmt == ".json" and _is_multiline_object(text):
        raise DatasetError(f"{path}: holds a single JSON object; expected a list of objects [{{...}}, ...] or "
                           "one object per line")
    else:
        rows, lines = _scan_json_lines(path, text)
    if not rows:
        raise DatasetError(f"{path} has no rows; write one JSON object per problem")
    _check_kinds(path, rows, lines, _candidate_fields(cfg))
    return rows, lines or [None] * len(rows)


def _scan_json_lines(path: Path, text: str) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    for num, line in numbered_lines(text):  # "\n" only: a JSON string may hold U+2028 or U+0085 raw
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path} line {num}: not valid JSON ({e.msg} at column {e.colno}); write one "
                               "JSON object per line") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{path} line {num}: expected a JSON object, got {type(row).__name__} "
                               f"{show(row)}")
        rows.append(row)
        lines.append(num)
    return rows, lines


def _scan_json_list(path: Path, text: str) -> list[dict]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); a .json "
                           "file holds a list of objects, or one object per line") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: expected a list of objects, got {type(rows).__name__}")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DatasetError(f"{path} row {bad}: expected a JSON object, got {type(rows[bad]).__name__} "
                           f"{show(rows[bad])}")
    return rows


def _is_multiline_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict) and "\n" in text.strip()
    except json.JSONDecodeError:
        return False


def _candidate_fields(cfg: DatasetConfig) -> list[str]:
    """The keys (or field paths) that may become the problem, answer or id."""
    problem = [cfg.problem_field] if cfg.problem_field else ["problem", "question"]
    return [*problem, cfg.answer_field, cfg.id_field or "id"]


def _json_kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _check_kinds(path: Path, rows: list[dict], lines: list[int] | None, fields: list[str]) -> None:
    """Each field (at its path, in the rows where the path resolves) holds one JSON type in every row."""
    for name in dict.fromkeys(fields):
        column, steps = parse_path(name, "." in name and any(name in row for row in rows))
        first: tuple[str, int] | None = None
        for i, row in enumerate(rows):
            value = row.get(column)
            if steps and value is not None:
                value = follow(value, steps)
            if value is None or value is MISSING:
                continue
            kind = _json_kind(value)
            if first is None:
                first = (kind, i)
            elif kind != first[0]:
                raise DatasetError(
                    f"{path} {_at(lines, i)}: field {name!r} is a {kind} but a {first[0]} at "
                    f"{_at(lines, first[1])}; a field must have one type in every row (datasets would read "
                    f"\"033\" back as 33): write every {name!r} as a string")


def _at(lines: list[int] | None, i: int) -> str:
    return f"line {lines[i]}" if lines else f"row {i}"
