"""A regular (non-editable) build ships every mapped package and the data files the code reads at run time."""
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
