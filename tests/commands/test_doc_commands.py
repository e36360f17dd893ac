"""Every command the documentation shows is one the code accepts, and the README's measured figures are the results
files'.

Commands: every `python -m miles_k3[.<cmd>] ...`, `torchrun ... -m miles_k3.<cmd> ...` and `miles-k3-<cmd> ...` in
README.md and docs/**/*.md, in fenced code blocks (backslash-continued lines joined; `#` comments dropped) and in
inline code, is one test case (page:line). It is checked the way the command itself would read it, short of running:

* Hydra apps (train, eval, sft, serve): the arguments go through Hydra's own command-line parser (so `--cfg job`
  and `--help` are Hydra's flags, anything else is refused), the overrides are composed from the recipes and the
  composed config is converted and validated as the entry point does (`config.to_typed`: unknown keys, wrong types
  and every section's `validate`). A command whose config asks for CUDA (`device=cuda`, or a recipe with
  `requires.device: cuda`) is validated as on a machine with 8 CUDA devices (torch.cuda patched): the doc means a
  GPU machine, and everything else is still checked. A `torchrun` command is parsed by torchrun's own parser and
  composed as rank 0 of its world (RANK, WORLD_SIZE = nnodes x nproc-per-node), then checked against that world as
  the run checks it at start (`ParallelConfig.check_world`); a `python -m` command is one process, unless it says
  launcher=ray (its world, ray.num_workers, is checked with the config; `ray job submit -- python -m ...` is its
  `python -m` command).
* model_info, init_checkpoint (key=value commands): composed and validated by `config.compose_cli`, what `main` runs.
* grade, quantize, config_reference (argparse): their `main` runs until its parser has parsed the arguments.
* `python -m miles_k3` takes no arguments.

Inline code with no arguments (`python -m miles_k3.init_checkpoint` writes ...) names a command: only that it exists
is checked. In a code block a command without arguments is run as is, so it is checked like any other.

Path fields are not checked for existence when a config is composed, so paths that do not exist here
(model.path=/ckpt/kimi-k3, data.source=problems.jsonl) are composed as written. Placeholders:

* `...` / `…` as a token ("more overrides") is dropped; as a value (`parallel.tp=...`, `lora.targets=[...]`) the
  override is dropped and its key must still be a field of the composed config (and a world-size check is skipped
  when a `parallel.*` value is elided).
* `[x]` standing alone is optional: it is included. `a|b` is a choice: each alternative is checked in turn.
* The single capitals S, N, K, G where a number goes (seed=S, --nproc-per-node N, checkpoint_every=K,
  parallel.ep=G) take the example values in PLACEHOLDER_NUMBERS; other capitals (DIR, FILE, SRC, DST, DATA,
  MODULE:FUNCTION) stay as written: they are strings to every parser, with one exception: `model.path=DIR` becomes
  a directory holding the real K3's config.json (`k3_config_dir`), since engine.backend=sglang reads DIR's
  config.json when the config is validated (`config_checks.check_backend`). A native run never reads it there.

Whether the Python sandbox starts on this machine (env.tools=[...,python] probes it when validated) is the
machine's business, not the doc's (tests/envs/test_sandbox.py): it is taken as available.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra._internal.utils import get_args_parser as hydra_parser  # hydra.main's command line
from omegaconf import OmegaConf
from repo_helpers import REPO as ROOT

from miles_k3.config import RECIPES_MODULE, compose_cli, register_schemas, to_typed
from miles_k3.envs import sandbox

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS = ROOT / "benchmarks/results"

APPS = {"": "none", "train": "hydra", "eval": "hydra", "sft": "hydra", "serve": "hydra", "model_info": "cli",
        "init_checkpoint": "cli", "grade": "argparse", "quantize": "argparse", "config_reference": "argparse"}
"""`miles_k3.<app>` -> how its command line is read: hydra (`@hydra.main`), cli (`config.compose_cli`), argparse,
none (`python -m miles_k3`: no arguments)."""
PLACEHOLDER_NUMBERS = {"S": "0", "N": "8", "K": "10", "G": "64"}
"""The docs' numeric placeholders (seed=S, --nproc-per-node N, checkpoint_every=K, parallel.ep=G) -> example values."""
ELIDED = ("...", "…", "[...]", "[…]")
SIMULATED_CUDA_DEVICES = 8

_START = re.compile(r"\btorchrun\s|\bpython3?\s+-m\s+miles_k3\b|(?<![\w/.-])miles-k3-\w")


@dataclass(frozen=True)
class DocCommand:
    page: str
    """Path relative to the repository root."""
    line: int
    """1-based line where the command (or its code block line) starts."""
    text: str
    """The command as written (continuations joined, `\\|` of tables unescaped)."""
    inline: bool = False
    """In inline code (else a code block): without arguments it names the command rather than runs it."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _commands_in(text: str) -> list[str]:
    """The commands in `text` (a code line or an inline code span): one per shell command (`a && b`) that runs
    miles_k3, from its launcher (`OMP_NUM_THREADS=1 python -m ...` -> `python -m ...`)."""
    commands = []
    for part in re.split(r"\s(?:&&|\|\||;|\|)\s", text.replace("\\|", "|")):
        m = _START.search(part)
        command = part[m.start():].strip() if m else ""
        if command and not (command.startswith("torchrun") and not re.search(r"\s-m\s+miles_k3\b", command)):
            commands.append(command)  # (a torchrun of something else is not ours)
    return commands


def _units(lines: list[str]) -> list[tuple[int, str]]:
    """(first line index, text) of the prose outside code blocks, by paragraph; a table row is a unit of its own."""
    units, current, start = [], [], 0
    for i, line in enumerate(lines + [""]):
        if not line.strip() or line.lstrip().startswith("|"):
            if current:
                units.append((start, "\n".join(current)))
                current = []
            if line.strip():
                units.append((i, line))
            continue
        if not current:
            start = i
        current.append(line)
    return units


def doc_commands(page: Path) -> list[DocCommand]:
    """The miles_k3 commands of one page: code block lines first (continuations joined), then inline code."""
    rel = str(page.relative_to(ROOT))
    lines = page.read_text().splitlines()
    found: list[DocCommand] = []
    prose = list(lines)
    in_fence, pending, pending_line = False, "", 0
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            prose[i] = ""
            continue
        if not in_fence:
            continue
        prose[i] = ""
        if not pending:
            pending_line = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found += [DocCommand(rel, pending_line + 1, c) for c in _commands_in(pending + line)]
        pending = ""
    for start, unit in _units(prose):
        for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", unit):
            line = start + unit[:m.start()].count("\n") + 1
            found += [DocCommand(rel, line, c, inline=True) for c in _commands_in(m.group(1).replace("\n", " "))]
    return list(dict.fromkeys(found))  # the same command twice on one line is one case


ALL_COMMANDS = [c for page in PAGES for c in doc_commands(page)]
_LINE_COUNTS = Counter(c.id for c in ALL_COMMANDS)
COMMAND_IDS = [c.id if _LINE_COUNTS[c.id] == 1 else f"{c.id}:{c.text.split()[0]}" for c in ALL_COMMANDS]


@dataclass
class Parsed:
    app: str
    variants: list[list[str]]
    """The argument lists to check: one per combination of the documented choices (a|b)."""
    elided: list[str]
    """Keys whose value the doc elides (key=...): they must be fields of the composed config."""
    world: int | None
    """torchrun's nnodes x nproc-per-node; None for a command without torchrun."""


def _number(token: str) -> str:
    return PLACEHOLDER_NUMBERS.get(token, token)


def parse_command(text: str) -> Parsed:
    """The command's app, argument lists and torchrun world, placeholders handled as the module docstring says."""
    text = re.sub(r"(?<!\S)\[([^\[\]]+)\](?!\S)", r"\1", text)  # [optional] -> optional; key=[a,b] stays a list
    tokens = [t for t in shlex.split(text, comments=True) if t not in ("...", "…")]
    world = None
    if tokens[0] == "torchrun":
        from torch.distributed.run import get_args_parser as torchrun_parser
        from torch.distributed.run import parse_min_max_nnodes

        launch = torchrun_parser().parse_args([_number(t) for t in tokens[1:]])
        assert launch.module, f"torchrun runs a module here (-m): {text}"
        world = parse_min_max_nnodes(launch.nnodes)[1] * int(launch.nproc_per_node)
        module, args = launch.training_script, launch.training_script_args
    elif tokens[0].startswith("miles-k3-"):
        module, args = "miles_k3." + tokens[0].removeprefix("miles-k3-").replace("-", "_"), tokens[1:]
    else:
        assert tokens[1] == "-m", text
        module, args = tokens[2], tokens[3:]
    assert module == "miles_k3" or module.startswith("miles_k3."), f"not a miles_k3 module: {module}"
    app = module.partition(".")[2]
    assert app in APPS, f"python -m {module}: no such command (known: {sorted(a for a in APPS if a)})"
    elided, kept = [], []
    for token in args:
        key, eq, value = token.partition("=")
        if eq and not key.startswith("-") and value in ELIDED:
            elided.append(key.lstrip("+~"))
            continue
        choices = value.split("|") if eq else token.split("|")
        kept.append([f"{key}={_number(c)}" if eq else _number(c) for c in choices])
    return Parsed(app, [list(v) for v in itertools.product(*kept)], elided, world)


def _field_exists(cfg, dotted: str) -> bool:
    node = cfg
    for part in dotted.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True


@pytest.fixture(scope="module")
def k3_config_dir(tmp_path_factory) -> Path:
    """A directory with the published K3's config.json only (MXFP4 experts): what `model.path=DIR` stands for."""
    from miles_k3.model.config import K3Config
    from miles_k3.model.weight_files import CONFIG_FILE, config_json

    path = tmp_path_factory.mktemp("k3_config")
    (path / CONFIG_FILE).write_text(json.dumps(config_json(K3Config.from_name("k3"), "mxfp4", None)))
    return path


def _check_hydra(app: str, argv: list[str], parsed: Parsed, monkeypatch, k3_dir: Path | None = None) -> None:
    if k3_dir is not None:
        argv = [f"model.path={k3_dir}" if a == "model.path=DIR" else a for a in argv]
    try:
        overrides = hydra_parser().parse_args(argv).overrides
    except SystemExit:
        pytest.fail(f"Hydra's command line refuses {argv}")
    if parsed.world is not None:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(parsed.world))
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda: None)  # this machine's, not the doc's (test_sandbox)
    register_schemas()
    with initialize_config_module(config_module=RECIPES_MODULE, version_base=None):
        raw = compose(config_name=app, overrides=overrides)
    device = str(OmegaConf.select(raw, "device", default="") or "")
    if device.startswith("cuda") or OmegaConf.select(raw, "requires.device", default="") == "cuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: SIMULATED_CUDA_DEVICES)
    cfg = to_typed(raw)
    missing = [k for k in parsed.elided if not _field_exists(cfg, k)]
    assert not missing, f"{missing}: not fields of the {app} config"
    parallel = getattr(cfg, "parallel", None)  # train's mesh; the other apps run one process
    assert parallel is not None or parsed.world is None, f"torchrun -m miles_k3.{app}: {app} has no parallel: section"
    on_ray = getattr(cfg, "launcher", None) == "ray"  # Ray starts ray.num_workers ranks (checked with the config)
    if parallel is not None and not on_ray and not any(k.startswith("parallel.") for k in parsed.elided):
        parallel.check_world(parsed.world or 1, launched=parsed.world is not None)


class _ArgsParsed(Exception):
    pass


def _check_argparse(app: str, argv: list[str], monkeypatch, capsys) -> None:
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise _ArgsParsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            importlib.import_module(f"miles_k3.{app}").main(argv)
        except _ArgsParsed:
            return
        except SystemExit as e:
            assert e.code == 0, f"python -m miles_k3.{app} {shlex.join(argv)}: {capsys.readouterr().err.strip()}"
            return
    pytest.fail(f"miles_k3.{app}.main never parsed its arguments")


def _check_cli(app: str, argv: list[str]) -> None:
    from miles_k3 import init_checkpoint

    init_checkpoint.register_schema()
    module = importlib.import_module(f"miles_k3.{app}")
    try:
        compose_cli(app, argv, f"miles_k3.{app}", module.USAGE)
    except SystemExit as e:
        assert e.code == 0, str(e)


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=COMMAND_IDS)
def test_documented_command_is_accepted(command: DocCommand, monkeypatch, capsys, k3_config_dir):
    parsed = parse_command(command.text)
    kind = APPS[parsed.app]
    assert parsed.world is None or kind == "hydra", f"torchrun of a non-Hydra command: {command.text}"
    for argv in parsed.variants:
        if command.inline and not argv:
            continue  # `python -m miles_k3.init_checkpoint` in a sentence names the command: it exists (parsed)
        try:
            if kind == "none":
                assert not argv, f"python -m miles_k3 takes no arguments: {argv}"
            elif kind == "hydra":
                _check_hydra(parsed.app, argv, parsed, monkeypatch, k3_config_dir)
            elif kind == "cli":
                _check_cli(parsed.app, argv)
            else:
                _check_argparse(parsed.app, argv, monkeypatch, capsys)
        except Exception as e:  # noqa: BLE001 - any refusal is the doc's to fix: say where and what
            pytest.fail(f"{command.id}: the documented command\n  {command.text}\nis refused (as {argv}):\n"
                        f"{type(e).__name__}: {e}")


def test_the_extraction_sees_every_command_and_form():
    """Guards the extractor itself: every command is documented somewhere, in each form (code block, inline code,
    continued lines, torchrun, console scripts), so a broken pattern cannot silently check nothing."""
    seen = {parse_command(c.text).app for c in ALL_COMMANDS}
    assert seen == set(APPS), sorted(set(APPS) - seen)
    texts = [c.text for c in ALL_COMMANDS]
    assert any(t.startswith("torchrun") and "checkpoint_every=10" in t for t in texts)  # README, continued lines
    assert any(t.startswith("miles-k3-") for t in texts)
    assert len(ALL_COMMANDS) >= 60, len(ALL_COMMANDS)
    assert _commands_in("OMP_NUM_THREADS=1 python -m miles_k3.sft a=1 && python -m miles_k3.quantize S D | tee x") \
        == ["python -m miles_k3.sft a=1", "python -m miles_k3.quantize S D"]
    assert _commands_in("torchrun --nproc-per-node 2 bench.py") == []


def test_parse_command_handles_the_placeholders():
    p = parse_command("torchrun --nproc-per-node N -m miles_k3.train parallel.tp=... seed=S [format=bf16|mxfp4] …")
    assert (p.app, p.world, p.elided) == ("train", 8, ["parallel.tp"])
    assert p.variants == [["seed=0", "format=bf16"], ["seed=0", "format=mxfp4"]]
    p = parse_command("python -m miles_k3.grade --data DATA [--grader aime|math] 'env.tools=[a,b]' lora.targets=[...]")
    assert p.variants == [["--data", "DATA", "--grader", "aime", "env.tools=[a,b]"],
                          ["--data", "DATA", "--grader", "math", "env.tools=[a,b]"]]
    assert p.elided == ["lora.targets"]


def test_a_wrong_documented_command_fails(monkeypatch, capsys):
    """What the suite is for: a renamed field, a misspelled override, a bad flag or a world that does not fit."""
    from miles_k3.config import ConfigFieldError

    with pytest.raises(Exception, match="rollout.group_sizes"):
        _check_hydra("train", ["rollout.group_sizes=4"], parse_command("python -m miles_k3.train"), monkeypatch)
    with pytest.raises(ConfigFieldError, match="world|dp x parallel.tp|processes"):
        cmd = parse_command("torchrun --nproc-per-node 4 -m miles_k3.train parallel.tp=8")
        _check_hydra("train", cmd.variants[0], cmd, monkeypatch)
    with pytest.raises(AssertionError, match="--scale-rules"):
        _check_argparse("quantize", ["SRC", "DST", "--scale-rules", "ceil"], monkeypatch, capsys)
    with pytest.raises(AssertionError, match="not fields"):
        cmd = parse_command("python -m miles_k3.train lora.target=...")
        _check_hydra("train", [], cmd, monkeypatch)


def test_the_app_table_is_the_code():
    """APPS names every command `python -m miles_k3` lists, and the Hydra ones are Hydra apps of their recipe
    (`@hydra.main(..., config_name=APP)` or `@hydra_app("miles_k3.APP", APP)`, miles_k3/cli.py)."""
    from miles_k3.__main__ import COMMANDS

    assert {module.partition(".")[2] for _, module, _ in COMMANDS} <= set(APPS)
    for app, kind in APPS.items():
        source = (ROOT / "miles_k3" / f"{app or '__main__'}.py").read_text()
        hydra_app = re.search(rf'@hydra\.main\([^)]*config_name="{app}"\)|@hydra_app\("miles_k3\.{app}", "{app}"\)',
                              source)
        assert (hydra_app is not None) == (kind == "hydra"), app


# --- the README's measured figures are the results files' ---------------------------------------------------------

def _results(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())["figures"]


def _shown(shown: str, value: float) -> bool:
    """`shown` (a figure as the README writes it) is `value` rounded to the digits shown."""
    decimals = len(shown.partition(".")[2])
    return abs(float(shown) - value) <= 0.5 * 10 ** -decimals + 1e-9


def _readme_figure(pattern: str) -> re.Match:
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    m = re.search(pattern, text)
    assert m, f"README.md no longer says {pattern!r}: update the figure check in tests/commands/test_doc_commands.py"
    return m


def test_readme_quickstart_figures_are_quickstart_seeds_json():
    """The example summary's figures are its seed's run, and the fresh-clone sentence its seed's gain and time
    (benchmarks/results/quickstart_seeds.json)."""
    figures = _results("quickstart_seeds")
    runs = {r["seed"]: r for r in figures["runs"]}
    summary_seed = int(_readme_figure(r"The summary above is one measured run, seed (\d+)")[1])
    run = runs[summary_seed]
    head = _readme_figure(r"miles_k3\.train: (\d+) steps \(1-\d+\) in (\d+) s")
    acc = _readme_figure(r"held-out avg@4: ([\d.]+)% \(step 0\) -> ([\d.]+)% \(step (\d+)\), \+([\d.]+) points")
    assert int(head[1]) == int(acc[3]) == figures["steps"][-1]
    assert float(head[2]) == run["wall_s"], (head[2], run["wall_s"])
    assert _shown(acc[1], run["curve"][0]) and _shown(acc[2], run["curve"][-1]), (acc.groups(), run["curve"])
    assert _shown(acc[4], run["gain_points"]), (acc[4], run["gain_points"])
    fresh = _readme_figure(r"the default, seed (\d+), gained \+([\d.]+) points in about (\d+) minutes")
    run = runs[int(fresh[1])]
    assert _shown(fresh[2], run["gain_points"]), (fresh[2], run["gain_points"])
    assert int(fresh[3]) == round(run["wall_s"] / 60), (fresh[3], run["wall_s"])


def test_readme_status_figures_are_the_results_files():
    """The Status section's agent-quickstart, partial-mode and session figures."""
    agent = _results("agent_quickstart_seeds")["runs"]
    m = _readme_figure(r"from ([\d.]+)% to ([\d.]+)-([\d.]+)% in (\d+) steps \((\w+) seeds, (\d)-(\d) minutes each")
    assert all(_shown(m[1], r["before_pct"]) for r in agent)
    assert _shown(m[2], min(r["after_pct"] for r in agent)) and _shown(m[3], max(r["after_pct"] for r in agent))
    assert all(r["curve"][-1]["step"] == int(m[4]) for r in agent) and m[5] == "three" and len(agent) == 3
    assert all(int(m[6]) * 60 <= r["train_wall_s"] <= int(m[7]) * 60 for r in agent), [r["train_wall_s"] for r in agent]
    m = _readme_figure(r"partial trained ([\d.]+)x the tokens per second of sync")
    assert _shown(m[1], _results("bench_partial")["partial_over_sync_tokens_per_s"])
    long = _results("bench_sessions_k3m2_e64_long")
    m = _readme_figure(r"kept state prefills (\d+)x fewer tokens and samples ([\d.]+)x faster")
    assert _shown(m[1], long["prefill_ratio"]) and _shown(m[2], long["time_ratio"])
    slots = _results("bench_sessions_k3m2_e64_slots32")
    m = _readme_figure(r"keeps the (\d+)x \(([\d.]+)x sampled tokens/s on an H100, (\d+) episodes on (\d+) slots")
    assert _shown(m[1], slots["prefill_ratio_snapshot"]) and _shown(m[2], slots["time_ratio_snapshot"])
    assert (int(m[3]), int(m[4])) == (slots["episodes"], slots["slots"])


def test_readme_install_torch_line_is_the_test_commands():
    """The Install section's torch line is the one the README's test command (CI's, .ci/run) runs."""
    text = (ROOT / "README.md").read_text()
    install = re.search(r"## Install\n.*?```bash\n(.*?)```", text, flags=re.DOTALL)
    assert install, "README.md: the Install section's ```bash block is missing"
    first = next(line for line in install.group(1).splitlines() if line.startswith("pip install torch"))
    ci = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    ci_torch = re.search(r"pip install torch\S*(?: --\S+ \S+)*", ci)
    assert ci_torch and first.partition("#")[0].strip() == ci_torch.group(0), (first, ci)
