"""Loading problems: local jsonl / json / parquet files and saved directories, the hub presets' column sets and
splits (with the hub loader replaced: nothing is downloaded), answers keeping their form, dotted field paths
into nested columns (verl format), and every error naming the file, row, field and fix."""
import json

import pytest

from miles_k3.evals import datasets as evds
from miles_k3.evals import problems as evproblems
from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.problems import DatasetError, Problem

datasets = pytest.importorskip("datasets")  # the module above imports it only when loading
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

# The hub datasets' columns (as published; the presets rely on them).
H4_AIME24 = ("id", "problem", "solution", "answer", "url", "year")
AIME25 = ("problem", "answer", "id")
AIMO_VAL = ("id", "problem", "solution", "answer", "url")
DAPO = ("data_source", "prompt", "ability", "reward_model", "extra_info")
DAPO_FIELDS = {"problem_field": "prompt.0.content", "answer_field": "reward_model.ground_truth"}


@pytest.fixture(autouse=True)
def _isolated_datasets(tmp_path, monkeypatch):
    """datasets' cache under tmp_path, and the hub off: a test that reached the network would fail."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, columns: dict):
    pq.write_table(pa.table(columns), path)
    return path


def load(source, **kw) -> list[Problem]:
    return load_problems(DatasetConfig(source=str(source), **kw))


def error(source, **kw) -> str:
    with pytest.raises(DatasetError) as e:
        load(source, **kw)
    return str(e.value)


# ---- presets and the hub schemas -------------------------------------------------------------------------------
def test_presets_know_the_hub_columns_and_splits():
    assert evds.PRESETS["HuggingFaceH4/aime_2024"] == evds.HubPreset("train", H4_AIME24)
    assert evds.PRESETS["math-ai/aime25"] == evds.HubPreset("test", AIME25)
    assert evds.PRESETS["AI-MO/aimo-validation-aime"] == evds.HubPreset("train", AIMO_VAL)
    assert evds.PRESETS["BytedTsinghua-SIA/DAPO-Math-17k"] == evds.HubPreset("train", DAPO)
    assert evds.default_split("someone/else") == "train"
    assert DatasetConfig().source == "HuggingFaceH4/aime_2024"


def test_h4_aime_2024_schema_from_jsonl(tmp_path):
    rows = [{"id": 60, "problem": "P60", "solution": "S", "answer": "204", "url": "u", "year": 2024},
            {"id": 61, "problem": "P61", "solution": "S", "answer": "033", "url": "u", "year": 2024}]
    assert tuple(rows[0]) == H4_AIME24
    got = load(write_jsonl(tmp_path / "aime24.jsonl", rows))
    assert got == [Problem("60", "P60", "204"), Problem("61", "P61", "033")]


def test_aime25_schema_from_parquet(tmp_path):
    cols = {"problem": ["P0", "P1"], "answer": ["070", "588"], "id": ["0", "1"]}
    assert tuple(cols) == AIME25
    got = load(write_parquet(tmp_path / "aime25.parquet", cols))
    assert got == [Problem("0", "P0", "070"), Problem("1", "P1", "588")]


def test_aimo_validation_schema_with_integer_answers(tmp_path):
    cols = {"id": [0, 1], "problem": ["P0", "P1"], "solution": ["S", "S"], "answer": [33, 5], "url": ["u", "u"]}
    assert tuple(cols) == AIMO_VAL
    assert load(write_parquet(tmp_path / "aimo.parquet", cols)) == [Problem("0", "P0", "33"), Problem("1", "P1", "5")]
    assert load(write_jsonl(tmp_path / "aimo.jsonl", [dict(zip(cols, v)) for v in zip(*cols.values())]))[0].answer \
        == "33"


# ---- answer forms and the three local formats ----------------------------------------------------------------
def test_leading_zero_answer_kept_in_every_format(tmp_path):
    rows = [{"problem": "a", "answer": "033"}, {"problem": "b", "answer": "7"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    (tmp_path / "list.json").write_text(json.dumps(rows, indent=2))
    write_jsonl(tmp_path / "lines.json", rows)  # JSON Lines in a .json file
    write_parquet(tmp_path / "p.parquet", {"problem": ["a", "b"], "answer": ["033", "7"]})
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("p.jsonl", "list.json", "lines.json", "p.parquet", "saved"):
        assert [p.answer for p in load(tmp_path / name)] == ["033", "7"], name
        assert [p.id for p in load(tmp_path / name)] == ["0", "1"], name  # no id column: row indexes


def test_numbers_become_their_str(tmp_path):
    write_parquet(tmp_path / "f.parquet", {"problem": ["a", "b"], "answer": pa.array([33.0, 0.5], pa.float64())})
    assert [p.answer for p in load(tmp_path / "f.parquet")] == ["33.0", "0.5"]
    write_jsonl(tmp_path / "i.jsonl", [{"problem": "a", "answer": 33}, {"problem": "b", "answer": 7}])
    assert [p.answer for p in load(tmp_path / "i.jsonl")] == ["33", "7"]


def test_question_column_custom_fields_and_limit(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [{"question": f"Q{i}", "answer": str(i), "gold": f"g{i}", "key": f"k{i}"}
                                       for i in range(5)])
    assert load(tmp_path / "q.jsonl", limit=2) == [Problem("0", "Q0", "0"), Problem("1", "Q1", "1")]
    got = load(tmp_path / "q.jsonl", problem_field="gold", answer_field="key", id_field="question", limit=10)
    assert got[4] == Problem("Q4", "g4", "k4") and len(got) == 5


def test_relative_path_and_saved_dataset_dict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "local.jsonl", [{"problem": "a", "answer": "1"}])
    assert load("local.jsonl") == [Problem("0", "a", "1")]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "tr", "answer": "1"}]),
                               "test": datasets.Dataset.from_list([{"problem": "te", "answer": "2"}])})
    dd.save_to_disk("dd")  # "dd" also looks like a hub id: the local directory wins
    assert load("dd")[0].problem == "tr" and load("dd", split="test")[0].problem == "te"
    assert "has no split 'dev' (splits: train, test); set data.split" in error("dd", split="dev")
    datasets.Dataset.from_list([{"problem": "one", "answer": "1"}]).save_to_disk("single")
    assert error("single", split="test").startswith("data.split='test': single holds one dataset, not splits")


def test_loading_leaves_progress_bars_as_they_were(tmp_path):
    before = datasets.are_progress_bars_disabled()
    load(write_jsonl(tmp_path / "p.jsonl", [{"problem": "a", "answer": "1"}]))
    assert datasets.are_progress_bars_disabled() == before


# ---- errors: files -----------------------------------------------------------------------------------------------
def test_missing_files(tmp_path):
    msg = error(tmp_path / "nope.jsonl")
    assert msg.startswith("data.source: no such file") and str(tmp_path / "nope.jsonl") in msg
    assert error("./data/problems").startswith("data.source: no such file")


def test_unsupported_file_type_and_plain_directory(tmp_path):
    (tmp_path / "p.csv").write_text("problem,answer\na,1\n")
    assert "unsupported file type '.csv'; use a .jsonl, .json or .parquet" in error(tmp_path / "p.csv")
    (tmp_path / "plain").mkdir()
    assert "not one written by datasets' save_to_disk" in error(tmp_path / "plain")


def test_malformed_jsonl_line_is_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, "", '{"problem": "b", answer: 2}'])
    msg = error(path)
    assert msg.startswith(f"{path} line 3: not valid JSON (")
    path = write_jsonl(tmp_path / "list.jsonl", [{"problem": "a", "answer": "1"}, "[1, 2]"])
    assert error(path) == f"{path} line 2: expected a JSON object, got list [1, 2]"


def test_malformed_json_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"problem": "a", "answer": "1"},\n  {"problem": "b" "answer": "2"}\n]\n')
    assert error(path).startswith(f"{path} line 3: not valid JSON (")
    path.write_text('{\n  "problem": "a",\n  "answer": "1"\n}\n')
    assert "holds a single JSON object; expected a list of objects" in error(path)
    path.write_text('[{"problem": "a", "answer": "1"}, "text"]')
    assert error(path) == f"{path} row 1: expected a JSON object, got str 'text'"


@pytest.mark.parametrize("suffix, head", [(".jsonl", b'{"problem": "a", "answer": "1"}\n\n'),
                                          (".json", b'[\n{"problem": "a", "answer": "1"},\n')])
def test_bad_utf8_names_the_file_and_line(tmp_path, suffix, head):
    """The message grade gives for its own files (evals.textfile.utf8_text): file, line, byte and the fix."""
    bad = b'{"problem": "caf\xe9", "answer": "2"}'  # latin-1, not UTF-8
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(head + bad + (b"]\n" if suffix == ".json" else b"\n"))
    at = bad.index(b"\xe9") + 1
    assert error(path) == (f"{path} line 3: not UTF-8 (byte 0xe9 at byte {at} of the line: invalid continuation "
                           "byte); save the file as UTF-8")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_line_separators_inside_json_strings_stay_in_their_row(tmp_path, suffix):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped: they are text, not line breaks (rows are split
    on "\\n" only), and the lines named in messages still count "\\n"s."""
    texts = ["x\u2028y", "p\x85q\u2029r", "plain"]
    rows = [{"id": str(i), "problem": t, "answer": str(i)} for i, t in enumerate(texts)]
    path = tmp_path / f"seps{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    else:
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    assert "\u2028" in path.read_text(encoding="utf-8")  # raw, not escaped
    assert [p.problem for p in load(path)] == texts
    if suffix == ".jsonl":
        with path.open("a", encoding="utf-8") as f:
            f.write('{"id": "3", "problem": "z\u2028", "answer": ""}\n')
        assert error(path).startswith(f"{path} row 3 (line 4): field 'answer' (the gold answer) is empty")


def test_unreadable_parquet_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet at all")
    assert error(path).startswith(f"data file {path} could not be read as parquet: ")


def test_empty_datasets(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    assert error(path) == f"{path} has no rows; write one JSON object per problem"
    path = write_parquet(tmp_path / "empty.parquet", {"problem": pa.array([], pa.string()),
                                                      "answer": pa.array([], pa.string())})
    assert error(path).startswith(f"{path} has no rows")


def test_local_file_has_only_the_train_split(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "a", "answer": "1"}])
    assert load(path, split="train") == [Problem("0", "a", "1")]
    assert error(path, split="test").startswith("data.split='test': a local file has one split, 'train'")


# ---- errors: rows and fields -------------------------------------------------------------------------------------
def test_row_missing_the_answer_field(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "a", "answer": "1"}, "",
                                              {"problem": "b", "solution": "s"}])
    assert error(path) == (f"{path} row 1 (line 3): missing field 'answer' (fields present: problem, solution); "
                           "add it, or set data.answer_field= to the field that holds it")


def test_null_and_empty_values_name_the_row(tmp_path):
    path = write_jsonl(tmp_path / "n.jsonl", [{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}])
    assert error(path).startswith(f"{path} row 1 (line 2): field 'answer' (the gold answer) is null")
    path = write_jsonl(tmp_path / "e.jsonl", [{"problem": "  ", "answer": "1"}])
    assert error(path).startswith(f"{path} row 0 (line 1): field 'problem' (the problem) is empty")
    path = write_parquet(tmp_path / "n.parquet", {"problem": ["a", None], "answer": ["1", "2"]})
    assert error(path).startswith(f"{path} row 1: field 'problem' (the problem) is null")
    path = write_parquet(tmp_path / "nan.parquet", {"problem": ["a"], "answer": [float("nan")]})
    assert error(path).startswith(f"{path} row 0: field 'answer' (the gold answer) is NaN")
    path = write_parquet(tmp_path / "nid.parquet", {"id": ["x", None], "problem": ["a", "b"], "answer": ["1", "2"]})
    assert error(path).startswith(f"{path} row 1: field 'id' (the id) is null")


def test_values_of_the_wrong_kind(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"problem": "a", "answer": [1, 2]}])
    assert error(path).startswith(f"{path} row 0 (line 1): field 'answer' (the gold answer) must be a string or a "
                                  "number, got list")
    path = write_parquet(tmp_path / "num.parquet", {"problem": [5], "answer": ["1"]})
    assert error(path).startswith(f"{path} row 0: field 'problem' (the problem) must be text, got int 5")


def test_mixed_types_in_a_field_are_rejected_before_033_becomes_33(tmp_path):
    path = write_jsonl(tmp_path / "mix.jsonl", [{"problem": "a", "answer": "033"}, {"problem": "b", "answer": 15}])
    msg = error(path)
    assert msg.startswith(f"{path} line 2: field 'answer' is a number but a string at line 1")
    assert "write every 'answer' as a string" in msg
    # a column that is not mapped may mix types
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"problem": "a", "answer": "033", "year": 2024},
                                             {"problem": "b", "answer": "1", "year": "2025"}])
    assert [p.answer for p in load(ok)] == ["033", "1"]


def test_duplicate_ids_name_both_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "problem": "a", "answer": "1"},
                                              {"id": "y", "problem": "b", "answer": "2"},
                                              {"id": "x", "problem": "c", "answer": "3"}])
    msg = error(path)
    assert msg.startswith(f"{path}: duplicate id 'x' in row 0 (line 1) and row 2 (line 3) (field 'id')")
    assert "set data.id_field=" in msg
    assert [p.id for p in load(path, limit=2)] == ["x", "y"]  # the first 2 rows alone are fine


def test_mapped_field_that_is_not_a_column(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"problem": "a", "gold": "1"}])
    assert error(path) == (f"{path}: no column 'answer'; the columns are problem, gold; set data.answer_field= to "
                           "the column that holds it")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}])
    msg = error(path)
    assert msg.startswith(f"{path}: no 'problem' or 'question' column; the columns are prompt, answer")
    assert "set data.problem_field=" in msg
    assert "no column 'uid'; the columns are prompt, answer; set data.id_field=" in error(
        path, problem_field="prompt", id_field="uid")


# ---- nested field paths (verl format: BytedTsinghua-SIA/DAPO-Math-17k) -------------------------------------
def dapo_prompt(problem):
    return (f"Solve the following math problem step by step.\n\n{problem}\n\nRemember to put your answer on "
            "its own line after \"Answer:\".")


def dapo_row(problem, answer, index="9a9b6eb4"):
    """A row as the hub dataset has it."""
    return {"data_source": "math_dapo", "prompt": [{"content": dapo_prompt(problem), "role": "user"}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lm"},
            "extra_info": {"index": index}}


def test_dapo_schema_from_jsonl_parquet_and_saved(tmp_path):
    rows = [dapo_row("P0", "34", "a"), dapo_row("P1", "034", "b"), dapo_row("P0", "34", "c")]  # P0 repeats
    assert tuple(rows[0]) == DAPO
    write_jsonl(tmp_path / "dapo.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    want = [Problem("0", dapo_prompt("P0"), "34"), Problem("1", dapo_prompt("P1"), "034"),
            Problem("2", dapo_prompt("P0"), "34")]
    for name in ("dapo.jsonl", "dapo.parquet", "saved"):
        assert load(tmp_path / name, **DAPO_FIELDS) == want, name
        assert load(tmp_path / name, limit=2, **DAPO_FIELDS) == want[:2], name


def test_rows_across_batches_keep_their_index(tmp_path, monkeypatch):
    monkeypatch.setattr(evproblems, "_BATCH", 2)
    rows = [dapo_row(f"P{i}", str(i)) for i in range(5)]
    path = write_jsonl(tmp_path / "dapo.jsonl", rows)
    assert [(p.id, p.answer) for p in load(path, **DAPO_FIELDS)] == [(str(i), str(i)) for i in range(5)]
    rows[3]["prompt"] = []
    msg = error(write_jsonl(path, rows), **DAPO_FIELDS)
    assert msg.startswith(f"{path} row 3 (line 4): data.problem_field 'prompt.0.content': 'prompt' is a list "
                          "of 0 items, no item 0; ")
    assert "set data.problem_field=" in msg


def test_id_from_a_nested_path(tmp_path):
    rows = [dapo_row("P0", "1", "a"), dapo_row("P1", "2", "b"), dapo_row("P2", "3", "a")]
    path = write_jsonl(tmp_path / "dapo.jsonl", rows)
    assert [p.id for p in load(path, id_field="extra_info.index", limit=2, **DAPO_FIELDS)] == ["a", "b"]
    msg = error(path, id_field="extra_info.index", **DAPO_FIELDS)
    assert msg.startswith(f"{path}: duplicate id 'a' in row 0 (line 1) and row 2 (line 3) (field "
                          "'extra_info.index'); ids must be unique")
    pq_path = tmp_path / "dapo.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq_path))
    assert error(pq_path, id_field="extra_info.index", **DAPO_FIELDS).startswith(
        f"{pq_path}: duplicate id 'a' in row 0 and row 2 (field 'extra_info.index')")


def test_path_past_the_end_of_a_list(tmp_path):
    rows = [dapo_row("P0", "1"), {**dapo_row("P1", "2"), "prompt": []}]
    path = write_jsonl(tmp_path / "short.jsonl", rows)
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): data.problem_field 'prompt.0.content': 'prompt' is a list of 0 items, no "
        "item 0")
    msg = error(path, problem_field="prompt.1.content", answer_field="reward_model.ground_truth")
    assert msg.startswith(f"{path} row 0 (line 1): data.problem_field 'prompt.1.content': 'prompt' is a list "
                          "of 1 item, no item 1; fix or drop the row, or set data.problem_field= to a path")
    for segment in ("first", "-1"):
        assert f"'prompt' is a list of 1 item, and '{segment}' is not an item number (0, 1, ...)" in error(
            path, problem_field=f"prompt.{segment}.content", answer_field="reward_model.ground_truth")


def test_path_to_a_missing_key(tmp_path):
    rows = [dapo_row("P0", "1"), {**dapo_row("P1", "2"), "reward_model": {"style": "rule-lm"}}]
    path = write_jsonl(tmp_path / "nokey.jsonl", rows)  # datasets fills the key with null: we name it missing
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): data.answer_field 'reward_model.ground_truth': 'reward_model' has no key "
        "'ground_truth' (keys: style); fix or drop the row, or set data.answer_field= to a path that every "
        "row has")
    pq_path = write_parquet(tmp_path / "nokey.parquet", {"prompt": [[{"content": "P0", "role": "user"}]],
                                                         "reward_model": [{"style": "rule-lm"}]})
    assert error(pq_path, **DAPO_FIELDS).startswith(
        f"{pq_path} row 0: data.answer_field 'reward_model.ground_truth': 'reward_model' has no key "
        "'ground_truth' (keys: style)")
    assert error(path, problem_field="prompt.0.text", answer_field="reward_model.ground_truth").startswith(
        f"{path} row 0 (line 1): data.problem_field 'prompt.0.text': 'prompt.0' has no key 'text' (keys: "
        "content, role)")


def test_path_indexing_into_a_string_or_null(tmp_path):
    rows = [dapo_row("P0", "1"), {**dapo_row("P1", "2"), "prompt": "Solve P1"}]  # datasets: a JSON column
    path = write_jsonl(tmp_path / "str.jsonl", rows)
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): data.problem_field 'prompt.0.content': 'prompt' is a string, not a list or "
        "object, so '0' cannot index it ('Solve P1')")
    pq_path = write_parquet(tmp_path / "str.parquet", {"prompt": ["Solve P0"],
                                                       "reward_model": [{"ground_truth": "1"}]})
    assert error(pq_path, **DAPO_FIELDS).startswith(
        f"{pq_path} row 0: data.problem_field 'prompt.0.content': 'prompt' is a string, not a list or "
        "object, so '0' cannot index it")
    assert "'prompt.0.content' is a string, not a list or object, so 'x' cannot index it" in error(
        path, problem_field="prompt.0.content.x", answer_field="reward_model.ground_truth")
    rows[1] = {**dapo_row("P1", "2"), "reward_model": None}
    assert error(write_jsonl(path, rows), **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): data.answer_field 'reward_model.ground_truth': 'reward_model' is null, not "
        "a list or object, so 'ground_truth' cannot index it;")


def test_path_whose_column_does_not_exist(tmp_path):
    path = write_jsonl(tmp_path / "dapo.jsonl", [dapo_row("P0", "1")])
    assert error(path, problem_field="messages.0.content", answer_field="reward_model.ground_truth") == (
        f"{path}: no column 'messages' (where the path 'messages.0.content' starts); the columns are "
        "data_source, prompt, ability, reward_model, extra_info; set data.problem_field= to the column that "
        "holds it (or a path into it: column.key.0)")
    assert "no column 'extra'" in error(path, id_field="extra.index", **DAPO_FIELDS)
    assert "data.problem_field 'prompt..content' has an empty segment" in error(
        path, problem_field="prompt..content", answer_field="reward_model.ground_truth")
    row = dapo_row("P0", "1")
    del row["reward_model"]
    path = write_jsonl(tmp_path / "missing.jsonl", [dapo_row("P0", "1"), row])
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): missing field 'reward_model' (fields present: data_source, prompt, ability, "
        "extra_info); add it, or set data.answer_field=")


def test_nested_null_and_empty_values_name_the_path(tmp_path):
    rows = [dapo_row("P0", "1"), dapo_row("P1", None)]
    path = write_jsonl(tmp_path / "null.jsonl", rows)
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): field 'reward_model.ground_truth' (the gold answer) is null; every row "
        "needs a gold answer")
    rows[1] = {**dapo_row("P1", "2"), "prompt": [{"content": "  ", "role": "user"}]}
    assert error(write_jsonl(path, rows), **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): field 'prompt.0.content' (the problem) is empty")
    pq_path = tmp_path / "null.parquet"
    datasets.Dataset.from_list([dapo_row("P0", "1", "a"), dapo_row("P1", "2", None)]).to_parquet(str(pq_path))
    assert error(pq_path, id_field="extra_info.index", **DAPO_FIELDS).startswith(
        f"{pq_path} row 1: field 'extra_info.index' (the id) is null")


def test_nested_values_of_the_wrong_kind(tmp_path):
    rows = [{**dapo_row("P0", "1"), "reward_model": {"ground_truth": {"value": "34"}, "style": "rule-lm"}}]
    path = write_jsonl(tmp_path / "dict.jsonl", rows)
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 0 (line 1): field 'reward_model.ground_truth' (the gold answer) must be a string or a "
        "number, got dict {'value': '34'}")
    assert error(path, problem_field="prompt.0", answer_field="reward_model.ground_truth.value").startswith(
        f"{path} row 0 (line 1): field 'prompt.0' (the problem) must be text, got dict {{'content': ")
    assert load(path, problem_field="prompt.0.content", answer_field="reward_model.ground_truth.value") == [
        Problem("0", dapo_prompt("P0"), "34")]


def test_nested_numbers_and_mixed_types(tmp_path):
    path = write_jsonl(tmp_path / "num.jsonl", [dapo_row("P0", 33), dapo_row("P1", 7)])
    assert [p.answer for p in load(path, **DAPO_FIELDS)] == ["33", "7"]
    path = write_jsonl(tmp_path / "mix.jsonl", [dapo_row("P0", "033"), dapo_row("P1", "1"),
                                                dapo_row("P2", 15)])
    msg = error(path, **DAPO_FIELDS)
    assert msg.startswith(f"{path} line 3: field 'reward_model.ground_truth' is a number but a string at "
                          "line 1")
    assert "write every 'reward_model.ground_truth' as a string" in msg
    lst = tmp_path / "mix.json"
    lst.write_text(json.dumps([dapo_row("P0", "033"), dapo_row("P1", 15)]))
    assert error(lst, **DAPO_FIELDS).startswith(
        f"{lst} row 1: field 'reward_model.ground_truth' is a number but a string at row 0")
    # a row where the path does not resolve is left to the row checks, which name it
    path = write_jsonl(tmp_path / "skip.jsonl", [dapo_row("P0", "033"),
                                                 {**dapo_row("P1", "1"), "reward_model": 5}])
    assert error(path, **DAPO_FIELDS).startswith(
        f"{path} row 1 (line 2): data.answer_field 'reward_model.ground_truth': 'reward_model' is a number, "
        "not a list or object, so 'ground_truth' cannot index it (5)")


def test_a_column_named_with_dots_is_used_as_is(tmp_path):
    rows = [{"problem": "a", "meta.answer": "033", "meta": {"answer": "999"}},
            {"problem": "b", "meta.answer": "7", "meta": {"answer": "999"}}]
    path = write_jsonl(tmp_path / "dots.jsonl", rows)
    assert [p.answer for p in load(path, answer_field="meta.answer")] == ["033", "7"]
    write_parquet(tmp_path / "dots.parquet", {"problem": ["a"], "meta.answer": ["033"],
                                              "meta": [{"answer": "9"}]})
    assert [p.answer for p in load(tmp_path / "dots.parquet", answer_field="meta.answer")] == ["033"]
    path = write_jsonl(tmp_path / "mix.jsonl", [{**rows[0], "meta.answer": 33}, rows[1]])
    assert error(path, answer_field="meta.answer").startswith(
        f"{path} line 2: field 'meta.answer' is a string but a number at line 1")
    # without such a column the same option is a path
    path = write_jsonl(tmp_path / "nested.jsonl", [{"problem": "a", "meta": {"answer": "042"}}])
    assert load(path, answer_field="meta.answer") == [Problem("0", "a", "042")]


# ---- the hub (loader replaced) --------------------------------------------------------------------------------
def fake_hub(monkeypatch, rows=None, exc=None):
    calls = []

    def load_dataset(path, split=None, revision=None, **kw):
        calls.append((path, split, revision))
        if exc is not None:
            raise exc
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_hub_ids_use_the_preset_split(monkeypatch):
    calls = fake_hub(monkeypatch, rows=[{"problem": "p", "answer": "004", "id": 7}])
    assert load("math-ai/aime25") == [Problem("7", "p", "004")]
    load("HuggingFaceH4/aime_2024")
    load("AI-MO/aimo-validation-aime", revision="abc123")
    load("someone/unknown")
    load("math-ai/aime25", split="train")
    assert calls == [("math-ai/aime25", "test", None), ("HuggingFaceH4/aime_2024", "train", None),
                     ("AI-MO/aimo-validation-aime", "train", "abc123"), ("someone/unknown", "train", None),
                     ("math-ai/aime25", "train", None)]


def test_dapo_hub_id_uses_its_preset_split(monkeypatch):
    calls = fake_hub(monkeypatch, rows=[dapo_row("P0", "34"), dapo_row("P1", "034")])
    assert load("BytedTsinghua-SIA/DAPO-Math-17k", **DAPO_FIELDS) == [Problem("0", dapo_prompt("P0"), "34"),
                                                                      Problem("1", dapo_prompt("P1"), "034")]
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "train", None)]
    fake_hub(monkeypatch, rows=[dapo_row("P0", "34"), {**dapo_row("P1", "1"), "prompt": []}])
    assert error("BytedTsinghua-SIA/DAPO-Math-17k", **DAPO_FIELDS).startswith(
        "hub dataset BytedTsinghua-SIA/DAPO-Math-17k [train] row 1: data.problem_field 'prompt.0.content': "
        "'prompt' is a list of 0 items, no item 0")


def test_hub_rows_are_checked_too(monkeypatch):
    fake_hub(monkeypatch, rows=[{"problem": "p", "answer": None}])
    assert error("math-ai/aime25").startswith("hub dataset math-ai/aime25 [test] row 0: field 'answer'")


def test_hub_without_network_says_how_to_work_offline(monkeypatch):
    calls = fake_hub(monkeypatch, exc=ConnectionError("Couldn't reach 'math-ai/aime25' on the Hub"))
    msg = error("math-ai/aime25")
    assert msg.startswith("data.source: could not load hub dataset 'math-ai/aime25' split 'test'")
    assert "Couldn't reach" in msg and "network access" in msg and "data.source=/path/file.jsonl" in msg
    assert calls == [("math-ai/aime25", "test", None)]


def test_hub_unknown_split(monkeypatch):
    fake_hub(monkeypatch, exc=ValueError('Unknown split "dev". Should be one of [\'train\'].'))
    assert error("HuggingFaceH4/aime_2024", split="dev").startswith(
        "data.split: hub dataset 'HuggingFaceH4/aime_2024' has no split 'dev'")


# ---- config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("source", ""), ("split", ""), ("problem_field", " "), ("id_field", ""),
                                          ("revision", ""), ("answer_field", ""), ("limit", 0), ("limit", True)])
def test_validate_names_the_field(field, value):
    cfg = DatasetConfig(**{field: value})
    with pytest.raises(ValueError) as e:
        cfg.validate()
    assert str(e.value).startswith(f"{field}: ")
    with pytest.raises(ValueError, match=f"^{field}: "):
        load_problems(cfg)  # checked before anything is read


def test_defaults_are_aime_2024_and_a_local_file_has_only_the_train_split(tmp_path):
    default = DatasetConfig()
    default.validate()
    assert (default.source, default.split, default.answer_field) == ("HuggingFaceH4/aime_2024", None, "answer")
    path = tmp_path / "q.jsonl"
    path.write_text('{"problem": "P", "answer": "1"}\n')
    assert load_problems(DatasetConfig(source=str(path), split="train")) == [Problem("0", "P", "1")]
    with pytest.raises(DatasetError, match=r"^data.split='test': a local file has one split, 'train'"):
        load_problems(DatasetConfig(source=str(path), split="test"))
