"""The user docs stay true: the README's two commands are the ones CI and the quickstart test run, the config
reference is the generator's current output, every metric a training run logs is in the metrics reference (and
every key listed there is still written by the code), and every relative link in README.md and docs/ resolves."""
import json
import re
from dataclasses import dataclass, field

import pytest
from repo_helpers import REPO as ROOT

from miles_k3 import config_reference

README = ROOT / "README.md"
DOCS = ROOT / "docs"
METRICS_DOC = DOCS / "reference" / "metrics.md"
SOURCES = ("miles_k3", "trainer", "rollout", "weight_sync", "evals")


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def test_readme_test_command_is_ci_run():
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m venv") and "pytest" in ci
    assert any(block.strip() == ci for block in _bash_blocks(README.read_text())), (
        f"README.md must hold .ci/run's command verbatim in a ```bash block:\n{ci}")


def test_readme_run_command_is_the_quickstart_tests_default():
    """`python -m miles_k3.train` with no arguments: the default recipe, the one tests/commands/test_quickstart.py
    composes with no recipe override."""
    blocks = _bash_blocks(README.read_text())
    assert any(line.strip() == "python -m miles_k3.train" for b in blocks for line in b.splitlines())
    quick = (ROOT / "tests/commands/test_quickstart.py").read_text()
    assert 'compose_config("train", ["steps=2"' in quick and "recipe=" not in quick


def test_readme_summary_example_is_what_the_loop_prints():
    """The README's example summary is format_summary's output for its own figures."""
    from miles_k3.train import format_summary

    text = README.read_text()
    block = re.search(r"```\n(miles_k3\.train: .*?)```", text, flags=re.DOTALL)
    assert block, "README.md: the example summary block (```\\nmiles_k3.train: ...```) is missing"
    lines = block.group(1).rstrip("\n").splitlines()
    head = re.fullmatch(r"miles_k3\.train: (\d+) steps \((\d+)-(\d+)\) in (\d+) s", lines[0])
    acc = re.fullmatch(r"  held-out (avg@\d+): ([\d.]+)% \(step (\d+)\) -> ([\d.]+)% \(step (\d+)\), [+-][\d.]+ points",
                       lines[1])
    fmt = re.fullmatch(r"  well-formed answers: ([\d.]+)% -> ([\d.]+)%", lines[2])
    assert head and acc and fmt, lines[:3]
    run_dir = lines[3].split()[-1]
    s = {"steps": int(head[1]), "first_step": int(head[2]), "last_step": int(head[3]), "wall_s": float(head[4]),
         "accuracy_metric": acc[1], "accuracy_before": float(acc[2]) / 100, "accuracy_before_step": int(acc[3]),
         "accuracy_after": float(acc[4]) / 100, "accuracy_after_step": int(acc[5]),
         "answer_rate_before": float(fmt[1]) / 100, "answer_rate_after": float(fmt[2]) / 100, "run_dir": run_dir,
         "adapter": f"{run_dir}/checkpoints/step_{int(head[3]):08d}/adapter", "metrics": f"{run_dir}/metrics.jsonl",
         "curves": f"{run_dir}/curves.png"}
    assert format_summary(s).splitlines() == lines


def test_config_reference_is_current():
    assert (DOCS / "reference/config.md").read_text() == config_reference.render(), (
        f"docs/reference/config.md is stale: regenerate it with `{config_reference.REGENERATE}`")


@dataclass
class _Inner:
    """A section."""

    samples: int = 1
    """How many."""


@dataclass
class _Outer:
    """A command."""

    steps: int = 3
    """Steps to run; 0 runs none."""
    name: str | None = None
    inner: _Inner = field(default_factory=lambda: _Inner(samples=4))
    """The section."""

    def validate(self) -> None:
        """Not a field."""


def test_config_reference_reads_attribute_docstrings():
    """A hand-made dataclass: the string under a field is its doc, a field without one gets none, methods are not
    fields, sections are linked and their changed defaults shown."""
    docs = config_reference.attribute_docs(_Outer)
    assert docs == {"steps": "Steps to run; 0 runs none.", "inner": "The section."}
    sections: dict = {}
    rows = config_reference.table(_Outer, "", sections)
    assert rows[:2] == ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    assert rows[2] == "| `steps` | `int` | `3` | Steps to run; 0 runs none. |"
    assert any(r.startswith("| `name` | `str \\| None` | `None` |") for r in rows)
    inner_row = next(r for r in rows if r.startswith("| `inner` |"))
    assert "[_Inner](#_inner)" in inner_row and "`_Inner(samples=4)`" in inner_row
    assert sections[_Inner] == "inner"


def _documented_keys() -> list[str]:
    """Every `prefix/...` key in the metrics reference's tables (first column and the perf/<phase>_s list)."""
    keys = re.findall(r"`((?:rollout|train|sync|perf|mem|eval|env|reward)/[^`]+)`", METRICS_DOC.read_text())
    return sorted(set(keys))


def _pattern(key: str) -> re.Pattern:
    return re.compile("[^/]+".join(re.escape(part) for part in re.split(r"<[a-z]+>", key)) + r"\Z")


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """Every key of metrics.jsonl after one k3_tiny step with an eval, routes recorded and a KL term (CPU)."""
    from miles_k3.config import compose_config
    from miles_k3.train import train

    tmp = tmp_path_factory.mktemp("metrics")
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i} + {i} = ?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    cfg = compose_config("train", [
        "steps=1", f"data.source={data}", "data.problem_field=null", f"run_dir={tmp}/run", "model=k3_tiny",
        "model.path=null", "reward=coin", "rollout.dynamic_sampling=false", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.template=plain", "engine.max_context=64",
        "engine.memory_budget_bytes=4194304", "lora.rank=2", "trainer.optim.total_steps=null",
        "rollout.return_routed_experts=true", "trainer.loss.kl_coef=0.01", "trainer.loss.tis=token_truncate",
        "eval.every_n_steps=1", f"eval.data.source={data}", "eval.data.problem_field=null", "eval.data.split=null", "eval.samples=2",
        "eval.max_new_tokens=4", "eval.template=plain", "eval.grading_workers=1"])
    train(cfg, "")
    rows = [json.loads(x) for x in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    return {k for r in rows for k in r if k != "step"}


def test_every_logged_metric_is_documented(logged_keys):
    patterns = [_pattern(k) for k in _documented_keys()]
    assert {"rollout/reward_mean", "train/kl", "train/route_mismatch_frac", "sync/version", "perf/step_s",
            "eval/avg@2"} <= logged_keys
    missing = sorted(k for k in logged_keys if not any(p.match(k) for p in patterns))
    assert not missing, f"metrics logged but not in docs/reference/metrics.md: {missing}"


def test_every_documented_metric_is_still_written():
    """A literal key must appear in the code as a string; a key with a placeholder must have its prefix there
    (`eval/avg@<n>`: the code writes `avg@{n}` under the eval/ prefix)."""
    code = "\n".join(p.read_text() for d in SOURCES for p in (ROOT / d).rglob("*.py"))
    stale = []
    for key in _documented_keys():
        if "<" in key:
            stem = key.split("/", 1)[1].split("<", 1)[0]
            if stem and stem not in code and f"{key.split('/')[0]}/" not in code:
                stale.append(key)
        elif re.fullmatch(r"perf/(rollout|release|train|resume|sync)_s", key):  # the step's phases: _Timer laps
            if f'lap("{key[5:-2]}")' not in code:
                stale.append(key)
        elif key.startswith("eval/"):
            if f'"{key.removeprefix("eval/")}"' not in code and f'{key.removeprefix("eval/")}=' not in code:
                stale.append(key)
        elif f'"{key}"' not in code:
            stale.append(key)
    assert not stale, f"docs/reference/metrics.md lists keys no code writes: {stale}"


def test_relative_links_resolve():
    broken = []
    for page in [README, *DOCS.rglob("*.md")]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"relative links to files that do not exist: {broken}"
