"""`python -m miles_k3.grade --data DATA --responses RESPONSES.jsonl [--grader aime]`: regrade saved generations.

RESPONSES.jsonl holds rows `{"id": ..., "response": "..."}`, several per problem id (the same number for every
id); DATA is a dataset source as in `eval.data.source` (a hub id or a local jsonl/json/parquet file) whose ids
and answers are the gold. Every response is graded (worker processes with a timeout, the same graders as the
training reward and `python -m miles_k3.eval`) and the summary (avg@n, pass@k, maj@k with standard errors) is
printed to stdout as JSON; `--out DIR` also writes results.jsonl and summary.json there. Users re-score other
systems' outputs, or try a new grader, without generating again.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles_k3.evals.datasets import DatasetConfig, load_problems
from miles_k3.evals.graders import MAX_RESPONSE_CHARS, grader_names
from miles_k3.evals.grading_pool import GradingPool
from miles_k3.evals.harness import EvalResult, GradedSample, outcomes_by_problem, write_reports
from miles_k3.evals.metrics import summarize
from miles_k3.evals.problems import DatasetError
from miles_k3.evals.textfile import numbered_lines, utf8_text


class ResponsesError(ValueError):
    """RESPONSES.jsonl is malformed: the message names the line and the fix."""


def read_responses(path: str | Path) -> dict[str, list[str]]:
    """Rows {"id", "response"} of a JSONL file grouped by id (string ids), in file order. Errors (ResponsesError)
    name the file and the 1-based line: bad UTF-8, bad JSON, a row without "id" or a string "response"."""
    path = Path(path)
    if not path.is_file():
        raise ResponsesError(f"--responses {path}: no such file")
    by_id: dict[str, list[str]] = {}
    for num, line in numbered_lines(utf8_text(path, ResponsesError)):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ResponsesError(f"{path} line {num}: not valid JSON ({e.msg} at column {e.colno}); write one "
                                 "JSON object per line") from None
        if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("response"), str):
            raise ResponsesError(f"{path} line {num}: expected an object with \"id\" and a string "
                                 f"\"response\", got {str(row)[:80]}")
        by_id.setdefault(str(row["id"]), []).append(row["response"])
    if not by_id:
        raise ResponsesError(f"{path}: no responses")
    return by_id


def regrade(data: DatasetConfig, responses: dict[str, list[str]], grader: str, timeout_s: float = 5.0,
            workers: int = 1, channel: str = "auto", ks: list[int] | None = None) -> EvalResult:
    """Grade `responses` (id -> responses) against `data`'s answers; every id must be in the data and have
    the same number of responses."""
    gold = {p.id: p for p in load_problems(data)}
    unknown = [i for i in responses if i not in gold]
    if unknown:
        raise ResponsesError(f"response id {unknown[0]!r} is not in {data.source} ({len(unknown)} unknown ids; "
                             f"data ids look like {list(gold)[:3]}); set --id-field if the data names ids "
                             "differently")
    counts = {i: len(r) for i, r in responses.items()}
    n = max(counts.values())
    short = next((i for i, c in counts.items() if c != n), None)
    if short is not None:
        raise ResponsesError(f"id {short!r} has {counts[short]} responses but others have {n}: every id needs "
                             "the same number (pass@k and maj@k compare like with like)")
    keys = [(i, j) for i in responses for j in range(n)]
    with GradingPool(grader, timeout_s=timeout_s, workers=workers, channel=channel,
                     max_chars=MAX_RESPONSE_CHARS) as pool:
        grades = pool.grade([responses[i][j] for i, j in keys], [gold[i].answer for i, _ in keys])
    records = [GradedSample(i, j, "", responses[i][j], g.extracted, g.normalized, gold[i].answer, g.score,
                            g.reason, "unknown", 0, None) for (i, j), g in zip(keys, grades)]
    summary = summarize(outcomes_by_problem(records), ks=ks)
    summary.update(grader=grader, data=data.source, missing_ids=sorted(set(gold) - set(responses)))
    return EvalResult(records, summary)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m miles_k3.grade", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="hub id or local jsonl/json/parquet file with the gold answers")
    ap.add_argument("--responses", required=True, help="JSONL rows {\"id\": ..., \"response\": ...}")
    ap.add_argument("--grader", default="aime", choices=grader_names())
    ap.add_argument("--split", default=None)
    ap.add_argument("--problem-field", default=None)
    ap.add_argument("--answer-field", default="answer")
    ap.add_argument("--id-field", default=None)
    ap.add_argument("--channel", default="auto", help="auto, none, k3 or think: the part of a response graded")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ks", default=None, help="comma-separated k for pass@k / maj@k (default: powers of 2, n)")
    ap.add_argument("--out", default=None, help="also write results.jsonl and summary.json into this directory")
    args = ap.parse_args(argv)
    data = DatasetConfig(source=args.data, split=args.split, problem_field=args.problem_field,
                         answer_field=args.answer_field, id_field=args.id_field)
    try:
        data.validate()
        ks = [int(k) for k in args.ks.split(",")] if args.ks else None
        result = regrade(data, read_responses(args.responses), args.grader, args.timeout_s, args.workers,
                         args.channel, ks)
    except (DatasetError, ResponsesError, ValueError) as e:
        print(f"miles_k3.grade: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.summary, indent=2), flush=True)  # first: a failing --out cannot lose it
    if args.out:
        try:
            write_reports(result, args.out)
        except OSError as e:
            print(f"miles_k3.grade: --out {args.out}: the reports could not be written ({e}); the summary on "
                  "stdout is complete: choose a writable --out to also get results.jsonl", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
