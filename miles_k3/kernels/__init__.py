"""Triton kernels (`miles_k3.kernels`), each beside its pure-torch reference; KDA comes from fla-core. They import
torch and triton only. Their files live in the repository's top-level `kernels/` folder, which has no __init__.py
so that it never shadows Hugging Face's `kernels` package: a checkout (or editable install) finds them through
this `__path__`; a wheel ships them as this folder's modules."""
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "kernels").is_dir():  # a checkout, not site-packages
    __path__.append(str(_ROOT / "kernels"))
