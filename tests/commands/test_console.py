"""A new user's first hour, on the console: the commands (`python -m miles_k3`, the console scripts, short
`--help`s), a quickstart run in a fresh directory (log lines above the progress bar, labelled step fields, no
config dumps, no fla warning, one tree per run and no ./outputs), and the run directory's files (a resume cuts
metrics.jsonl back to its checkpoint, wandb missing fails at validation, curves.png's figure).

Entry points run as subprocesses in tmp_path (their working directory), on one thread, with the warnings a user
sees (no PYTHONWARNINGS=ignore).
"""
import importlib
import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from repo_helpers import REPO as ROOT

from miles_k3.config import ConfigFieldError, compose_config

SCRIPTS = {"miles-k3-train": "miles_k3.train:main", "miles-k3-eval": "miles_k3.eval:main",
           "miles-k3-sft": "miles_k3.sft:main", "miles-k3-grade": "miles_k3.grade:main"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(argv: list[str], cwd: Path, merged: bool = False) -> subprocess.CompletedProcess:
    """`argv` (a module's `-m` arguments, or a script path first) in `cwd`; merged: stderr into stdout, in the
    order written (a terminal's view)."""
    cmd = argv if Path(argv[0]).is_absolute() else [sys.executable, "-m", *argv]
    return subprocess.run(cmd, cwd=cwd, env=_env(), text=True, timeout=600, check=False, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE)


# ---- commands ------------------------------------------------------------------------------------------------
def _pyproject_scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts] table (name = "module:function" lines; tomllib is Python >= 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("\n[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', table, re.MULTILINE))


def test_pyproject_scripts_are_the_entry_points_mains():
    scripts = _pyproject_scripts()
    assert scripts == SCRIPTS
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_python_m_miles_k3_lists_every_command_one_line_each(tmp_path):
    proc = _run(["miles_k3"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()[1:]
    modules = [re.search(r"python -m (miles_k3\.\w+)", line).group(1) for line in lines]
    assert modules == ["miles_k3.train", "miles_k3.eval", "miles_k3.sft", "miles_k3.grade", "miles_k3.serve",
                       "miles_k3.init_checkpoint", "miles_k3.model_info", "miles_k3.quantize"]
    for script, target in SCRIPTS.items():  # a script's line names the module it runs
        (line,) = [x for x in lines if x.split()[0] == script]
        assert f"python -m {target.split(':')[0]} " in line
    for module in modules:
        assert callable(importlib.import_module(module).main), module


@pytest.fixture(scope="module")
def help_of(tmp_path_factory):
    """`python -m miles_k3.<app> --help` as (the process, its working directory, empty before), run once per app for
    the module: test_help_is_short_and_lists_its_own_recipes_only and the console script's test read the same."""
    done: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def get(app: str) -> tuple[subprocess.CompletedProcess, Path]:
        if app not in done:
            cwd = tmp_path_factory.mktemp(f"help-{app}")
            done[app] = _run([f"miles_k3.{app}", "--help"], cwd), cwd
        return done[app]
    return get


@pytest.mark.slow
def test_installed_console_script_runs_the_module(tmp_path, help_of):
    script = Path(sys.executable).parent / "miles-k3-train"
    if not script.exists():
        pytest.skip("the console scripts are not installed in this environment: pip install -e .")
    via_script, (via_module, _) = _run([str(script), "--help"], tmp_path), help_of("train")
    assert via_script.returncode == 0 and via_module.returncode == 0 and via_script.stdout == via_module.stdout


def _recipes_by_app() -> dict[str, set[str]]:
    """Each recipe under the entry point its first command line runs."""
    out: dict[str, set[str]] = {}
    for p in resources.files("miles_k3.recipes").joinpath("recipe").iterdir():
        if p.name.endswith(".yaml"):
            command = next(x for x in p.read_text().splitlines() if x.startswith("# python -m miles_k3."))
            out.setdefault(command.split()[3].removeprefix("miles_k3."), set()).add(p.name.removesuffix(".yaml"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("app", ["train", "eval", "sft"])
def test_help_is_short_and_lists_its_own_recipes_only(app, help_of):
    proc, cwd = help_of(app)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert len(text.splitlines()) < 60 and "== Config ==" not in text  # not the full config dump
    assert text.startswith(f"python -m miles_k3.{app} ")
    by_app = _recipes_by_app()
    assert by_app[app], app
    for other, recipes in by_app.items():
        for recipe in recipes:
            listed = re.search(rf"^\s+{recipe}\s", text, re.MULTILINE) is not None
            assert listed == (other == app), (recipe, other)
    overrides = re.findall(r"^\s+([\w.]+)=\S*\s{2,}\S", text, re.MULTILINE)
    assert 8 <= len(overrides) <= 10, overrides
    assert f"python -m miles_k3.{app} [overrides] --cfg job" in text
    assert not list(cwd.iterdir())  # --help writes nothing


@pytest.mark.slow
@pytest.mark.parametrize("app, fields", [
    ("model_info", ["model", "model.path", "model.experts", "parallel.tp", "parallel.ep", "gpus", "batch",
                    "context", "micro_batch_tokens", "lora.rank"]),
    ("init_checkpoint", ["model", "model.path", "out", "seed", "format", "overwrite", "max_shard_bytes", "hollow"]),
])
def test_module_commands_print_their_usage(app, fields, tmp_path, monkeypatch, capsys):
    """The commands that are not Hydra apps: --help is a short usage text (what it does, its fields, an example
    that composes), not Hydra's override parse error; -h prints the same (in-process, through the command's main:
    what `python -m` calls with sys.argv[1:]); another --flag is refused in one line."""
    proc = _run([f"miles_k3.{app}", "--help"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    text = proc.stdout
    assert text.startswith(f"python -m miles_k3.{app} ") and len(text.splitlines()) < 30
    listed = re.findall(r"^  ([\w.]+)=\S*\s{2,}\S", text, re.MULTILINE)
    assert listed == fields, listed
    (example,) = re.findall(rf"^Example:  python -m miles_k3\.{app} (.*)$", text, re.MULTILINE)
    if app == "init_checkpoint":
        importlib.import_module("miles_k3.init_checkpoint").register_schema()
    compose_config(app, example.split())
    assert not list(tmp_path.iterdir())
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as short:
        importlib.import_module(f"miles_k3.{app}").main(["-h"])
    assert short.value.code == 0 and capsys.readouterr().out == text
    assert not list(tmp_path.iterdir())
    bad = _run([f"miles_k3.{app}", "--tp=2"], tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    refusal = f"miles_k3.{app}: --tp=2: not an option; arguments are key=value overrides (python -m miles_k3.{app} --help)"
    assert bad.stderr.strip().splitlines() == [refusal]


# ---- a first run ---------------------------------------------------------------------------------------------
STEP = re.compile(r"step (\d)/2 reward=\S+ accuracy=[\d.]+% loss=\S+ grad_norm=\S+ logprob_gap=\S+ sync_s=\S+ "
                  r"step_s=\S+$")


@pytest.mark.slow
def test_quickstart_in_a_fresh_directory(tmp_path):
    """What the issue's first command prints and leaves behind (2 steps of the shipped quickstart)."""
    proc = _run(["miles_k3.train", "steps=2", "eval.every_n_steps=0"], tmp_path, merged=True)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    assert "Triton is not supported" not in out and "UserWarning" not in out
    assert "{'mem/" not in out and "q_proj,k_proj" not in out  # the dumps are at DEBUG
    assert re.search(r"rollout engine: \d+ slots, \d+ pages of \d+ tokens, decode=eager$", out, re.MULTILINE)
    assert "LoRA rank 8 on 20 target module names: 156,064 trainable params" in out
    # each step's log line starts its own line: the bar is cleared before it, not written into it
    lines = [line.split("\r")[-1] for line in out.split("\n") if " step " in line and "/2 " in line]
    assert [STEP.search(x).group(1) for x in lines] == ["1", "2"], lines
    assert all(x.startswith("[") and "train:" not in x for x in lines), lines
    assert not (tmp_path / "outputs").exists()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("train-")
    for name in (".hydra/config.yaml", "train.log", "metrics.jsonl", "curves.png", "checkpoints/latest"):
        assert (run_dir / name).exists(), name
    assert f"run_dir:  runs/{run_dir.name}\n" in out and "miles_k3.train: 2 steps (1-2) in " in out
    saved = (run_dir / "checkpoints/step_00000002/config.yaml").read_text()
    assert f"run_dir: runs/{run_dir.name}\n" in saved  # the record names its own run directory


@pytest.mark.slow
def test_eval_in_a_fresh_directory_keeps_hydra_in_its_run_dir(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "question": "1 + 1 = ?", "answer": "2"}) + "\n")
    proc = _run(["miles_k3.eval", "model=k3_tiny", "device=cpu", "eval.data.source=p.jsonl", "eval.samples=1",
                 "eval.max_new_tokens=2", "eval.template=plain", "eval.temperature=0", "engine.max_context=64",
                 "engine.memory_budget_bytes=2097152"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # stdout is the summary alone
    assert "Triton is not supported" not in proc.stderr and "UserWarning" not in proc.stderr
    assert re.search(r"rollout engine: \d+ slots, \d+ pages of \d+ tokens, decode=eager$", proc.stderr, re.MULTILINE)
    assert not (tmp_path / "outputs").exists()
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("eval-") and summary["summary"] == f"runs/{run_dir.name}/summary.json"
    for name in (".hydra/config.yaml", "eval.log", "summary.json", "results.jsonl"):
        assert (run_dir / name).exists(), name


@pytest.mark.slow
@pytest.mark.parametrize("app, overrides, made", [
    ("train", ["data.source=p.jsonl", "data.problem_field=question", "steps=1", "rollout.prompts_per_step=1",
               "eval.every_n_steps=0"], ["train.log", "metrics.jsonl", "checkpoints/latest"]),
    ("eval", ["model=k3_tiny", "eval.data.source=p.jsonl", "eval.samples=1", "eval.max_new_tokens=2",
              "eval.template=plain", "engine.max_context=64", "engine.memory_budget_bytes=2097152"],
     ["eval.log", "summary.json", "results.jsonl"]),
    ("sft", ["data.source=p.jsonl", "steps=1", "batch_size=1"], ["sft.log", "config.yaml", "model/config.json"]),
])
def test_run_dir_null_is_the_default_run_dir(app, overrides, made, tmp_path):
    """run_dir=null (hydra.run.dir falls back through miles_k3.or_default): the default runs/<app>-<date>-<time>,
    one directory holding Hydra's record and the run's files, as without the override."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "question": "1+1", "answer": "2"}) + "\n")
    proc = _run([f"miles_k3.{app}", "run_dir=null", "device=cpu", *overrides], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(rf"{app}-\d{{8}}-\d{{6}}", run_dir.name), run_dir.name
    for name in (".hydra/config.yaml", *made):
        assert (run_dir / name).exists(), name
    if app == "eval":
        assert json.loads(proc.stdout)["summary"] == f"runs/{run_dir.name}/summary.json"
    else:  # the config the run saves names its directory
        saved = run_dir / ("checkpoints/step_00000001/config.yaml" if app == "train" else "config.yaml")
        assert f"run_dir: runs/{run_dir.name}\n" in saved.read_text()


@pytest.mark.parametrize("argv, made", [(["miles_k3.model_info", "model=k3_tiny"], set()),
                                        (["miles_k3.init_checkpoint", "model=k3_tiny", "out=ckpt"], {"ckpt"})])
def test_commands_without_a_run_dir_leave_only_what_they_make(tmp_path, argv, made):
    proc = _run(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == made


def test_step_line_labels_its_fields_in_a_fixed_order():
    from miles_k3.train import step_line

    m = {"perf/step_s": 0.8131, "sync/seconds": 0.01988, "train/rollout_logprob_abs_diff": 4.063e-07,
         "train/grad_norm": 0.5305, "train/loss": -0.009071, "rollout/accuracy": 0.18359375,
         "rollout/reward_mean": 0.18359375, "train/empty_step": 0.0}
    assert step_line(2, 500, m) == ("step 2/500 reward=0.1836 accuracy=18.4% loss=-0.009071 grad_norm=0.5305 "
                                    "logprob_gap=4.063e-07 sync_s=0.01988 step_s=0.8131")
    empty = {k: v for k, v in m.items() if not k.startswith("train/")} | {"train/empty_step": 1.0}
    assert step_line(3, 500, empty) == ("step 3/500 reward=0.1836 accuracy=18.4% loss=- grad_norm=- "
                                        "logprob_gap=- sync_s=0.01988 step_s=0.8131 empty=1")


def test_summary_counts_the_steps_run_this_time():
    from miles_k3.train import format_summary

    s = {"steps": 20, "first_step": 21, "last_step": 40, "wall_s": 16.2, "run_dir": "runs/x"}
    assert format_summary(s).splitlines()[0] == "miles_k3.train: 20 steps (21-40) in 16 s"
    assert format_summary(s | {"steps": 1, "first_step": 40}).splitlines()[0] == "miles_k3.train: 1 step (40-40) in 16 s"
    assert format_summary(s | {"steps": 0}).splitlines()[0] == "miles_k3.train: 0 steps in 16 s"


# ---- the run directory ---------------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_resume_truncates_metrics_and_tables_to_the_checkpoint_step(tmp_path):
    from miles_k3.utils.tracking import truncate_after

    metrics = tmp_path / "metrics.jsonl"
    steps = [0, 1, 2, 3, 4, None]  # a run checkpointed at step 2, killed while writing step 5's row
    metrics.write_text("".join(json.dumps({"step": s, "train/loss": 0.1}) + "\n" for s in steps)
                       + '{"step": 5, "train/lo')  # torn by the kill
    table = tmp_path / "tables/rollout_samples.jsonl"
    table.parent.mkdir()
    table.write_text("".join(json.dumps({"step": s, "response": "x"}) + "\n" for s in (1, 2, 3, 3)))
    assert truncate_after(tmp_path, 2) == 3 + 2
    assert [r["step"] for r in _rows(metrics)] == [0, 1, 2, None]
    assert [r["step"] for r in _rows(table)] == [1, 2]
    assert truncate_after(tmp_path, 2) == 0 and not list(tmp_path.rglob(".*tmp*"))  # renamed into place


def test_wandb_missing_fails_at_validation_with_both_install_commands(tmp_path, monkeypatch):
    from miles_k3.utils import tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigFieldError, match=r"^tracking.logger: wandb is not installed; pip install -e "
                                               r"'\.\[wandb\]' \(from a checkout\) or pip install "
                                               r"'miles-k3\[wandb\]'"):
        compose_config("train", ["tracking.logger=wandb"])
    with pytest.raises(ValueError, match="wandb is not installed"):
        tracking.Tracker(tracking.TrackingConfig(logger="wandb"), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing created: no empty metrics.jsonl left behind
    assert compose_config("train", ["tracking.logger=none"]).tracking.logger == "none"


def test_curves_figure_titles_the_run_draws_accuracy_in_percent_with_its_band_and_smooths_steps(tmp_path,
                                                                                               monkeypatch):
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    from miles_k3.utils import tracking
    from miles_k3.utils.tracking import Tracker, TrackingConfig, curve_series, curves_figure, ema

    assert ema([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # bias-corrected: no ramp from 0
    assert ema([0.0, 1.0], weight=0.8) == pytest.approx([0.0, 0.2 / 0.36])
    rows = [{"step": s, "rollout/reward_mean": r, "perf/step_s": 1.0} for s, r in ((1, 0.1), (2, 0.5), (3, 0.3))]
    rows += [{"step": 0, "eval/avg@4": 0.17, "eval/avg@4_se": 0.02}, {"step": 3, "eval/avg@4": 0.25,
                                                                      "eval/avg@4_se": 0.03}]
    series = curve_series(rows)
    assert set(series) == {"rollout/reward_mean", "eval/avg@4", "eval/avg@4_se"}
    fig = curves_figure(series, "train-20261201-105655")
    try:
        assert fig._suptitle.get_text() == "train-20261201-105655"
        acc, reward = fig.axes  # no panel of its own for the _se key
        assert acc.get_ylabel() == "eval/avg@4 (%)" and list(acc.lines[0].get_ydata()) == pytest.approx([17, 25])
        (band,) = [c for c in acc.collections if isinstance(c, PolyCollection)]
        ys = band.get_paths()[0].vertices[:, 1]
        assert min(ys) == pytest.approx(15.0) and max(ys) == pytest.approx(28.0)  # +-1 s.e., in %
        raw, smooth = reward.lines
        assert list(raw.get_ydata()) == [0.1, 0.5, 0.3] and raw.get_alpha() < 1
        assert list(smooth.get_ydata()) == pytest.approx(ema([0.1, 0.5, 0.3]))
    finally:
        plt.close(fig)
    titles = []
    monkeypatch.setattr(tracking, "curves_figure", lambda series, title: titles.append(title) or real(series, title))
    real = curves_figure
    with Tracker(TrackingConfig(), tmp_path / "my-run") as tracker:  # finish() draws curves.png
        tracker.log({"rollout/reward_mean": 0.5}, step=1)
    assert titles == ["my-run"] and (tmp_path / "my-run/curves.png").is_file()
