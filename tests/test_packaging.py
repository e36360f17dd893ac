"""A regular (non-editable) build ships every mapped package, the data files the code reads at run time and the
console scripts."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_mapped_packages_recipes_and_model_configs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("miles_k3-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("rollout", "trainer", "weight_sync", "evals", "kernels", "recipes", "model"):
        assert f"miles_k3/{folder}/__init__.py" in names, folder
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


def test_no_top_level_folder_shadows_an_installed_package():
    """Run from the repository root (`python -m pytest`, `python -m miles_k3.train`), the working directory is on
    sys.path, so each top-level folder with an __init__.py imports under its own name: none may be the import name
    of an installed distribution. (transformers >= 5.25 imports Hugging Face's `kernels`, which the kernels' folder
    shadowed while it was called `kernels/`: it is `k3_kernels/`.)"""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert "k3_kernels" in folders and "kernels" not in folders
    clashes = {f: installed[f] for f in folders if f in installed and set(installed[f]) != {"miles-k3"}}
    assert not clashes, f"top-level folders shadowing installed packages: {clashes}"
