"""A regular (non-editable) build ships every mapped package, the data files the code reads at run time and the
console scripts; the kernels' folder `kernels/` imports as `miles_k3.kernels` from a checkout and from the wheel
without ever being the top-level `kernels` (Hugging Face's package of that name)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_helpers import REPO as ROOT


@pytest.mark.slow
def test_wheel_contains_mapped_packages_recipes_and_model_configs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("miles_k3-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("rollout", "trainer", "weight_sync", "evals", "recipes", "model"):
        assert f"miles_k3/{folder}/__init__.py" in names, folder
    kernel_modules = sorted(p.stem for p in (ROOT / "kernels").glob("*.py"))
    assert "mxfp4" in kernel_modules and "sampling" in kernel_modules
    for module in kernel_modules:  # a namespace subpackage in the wheel (kernels/ has no __init__.py)
        assert f"miles_k3/kernels/{module}.py" in names, module
    for data in ("miles_k3/recipes/train.yaml", "miles_k3/recipes/model_info.yaml",
                 "miles_k3/recipes/recipe/aime_grpo.yaml", "miles_k3/recipes/recipe/quickstart.yaml",
                 "miles_k3/recipes/model/k3.yaml", "miles_k3/model/configs/k3.json",
                 "miles_k3/model/configs/k3_m.json", "miles_k3/model/configs/k3_tiny.json"):
        assert data in names, data
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"miles_k3"}  # the only import name
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode().split("[console_scripts]\n")[1].split("\n[")[0]
    assert sorted(x for x in scripts.splitlines() if x.strip()) == ["miles-k3-eval = miles_k3.eval:main", "miles-k3-grade = miles_k3.grade:main",
                                           "miles-k3-sft = miles_k3.sft:main", "miles-k3-train = miles_k3.train:main"]
    # Unpacked and first on sys.path, run away from the repository: every kernel module imports from the wheel.
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    files = _python(f"import sys; sys.path.insert(0, {str(unpacked)!r}); import importlib; "
                    f"print([importlib.import_module('miles_k3.kernels.' + m).__file__ for m in {kernel_modules!r}])",
                    cwd=tmp_path)
    assert files == str([str(unpacked / "miles_k3" / "kernels" / f"{m}.py") for m in kernel_modules])


def _python(code: str, cwd: Path, **env: str) -> str:
    """The stripped stdout of `python -c code` run in `cwd` (its sys.path[0]), with `env` added."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_checkout_imports_the_kernels_folder_as_miles_k3_kernels():
    """From the repository root (a checkout, or an editable install), `miles_k3.kernels` is the package in
    `miles_k3/kernels/` and its modules are the files of the top-level `kernels/`."""
    out = _python("import miles_k3.kernels as k, miles_k3.kernels.mxfp4 as m, miles_k3.kernels.sampling as s; "
                  "print(k.__file__, m.__file__, s.__file__)", cwd=ROOT)
    assert out.split() == [str(ROOT / "miles_k3" / "kernels" / "__init__.py"), str(ROOT / "kernels" / "mxfp4.py"),
                           str(ROOT / "kernels" / "sampling.py")]


def test_kernels_folder_never_shadows_an_installed_kernels_package(tmp_path):
    """`kernels/` has no __init__.py, so from the repository root it is at most a namespace portion: a regular
    `kernels` package anywhere on sys.path (here a stand-in for Hugging Face's, after the working directory)
    wins."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    out = _python("import kernels; print(kernels.__file__)", cwd=ROOT, PYTHONPATH=str(tmp_path))
    assert out == str(tmp_path / "kernels" / "__init__.py")


def test_no_top_level_folder_shadows_an_installed_package():
    """Run from the repository root (`python -m pytest`, `python -m miles_k3.train`), the working directory is on
    sys.path, so each top-level folder with an __init__.py imports under its own name: none may be the import name
    of an installed distribution. (`kernels/` has none, so it is exempt: transformers >= 5.25 imports Hugging Face's
    `kernels`, which a regular package there would shadow; see the test above.)"""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert "kernels" not in folders and "rollout" in folders
    clashes = {f: installed[f] for f in folders if f in installed and set(installed[f]) != {"miles-k3"}}
    assert not clashes, f"top-level folders shadowing installed packages: {clashes}"
