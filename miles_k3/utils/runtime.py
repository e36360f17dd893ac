"""Device and precision, chosen once at start and logged with the reason (the same code runs on CPU)."""
import logging
import os
from collections import Counter

import torch

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FP32_DOTS = ("auto", "tf32", "tf32x3", "ieee")
"""`model.fp32_dots`: how Triton kernels multiply fp32 operands in `tl.dot` when they leave the precision at its
default (fla-core's KDA chunk kernels do, forward and backward). auto: Triton's own default (TF32 tensor cores on
NVIDIA, ~1e-3 relative per product), or whatever TRITON_F32_DEFAULT already says; tf32x3: three TF32 products,
~fp32 accuracy; ieee: plain fp32 FMA, slowest."""
FP32_DOTS_ENV = "TRITON_F32_DEFAULT"


def set_threads(threads: int) -> None:
    """`threads`: torch's CPU threads for this process (intra-op; torch.set_num_threads), logged; 0 leaves torch's
    own default (one per core, or OMP_NUM_THREADS when set)."""
    if threads < 0:
        raise ValueError(f"threads: must be >= 0 (0: torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)
    log.info("cpu threads=%d (%s)", torch.get_num_threads(), "as configured" if threads else
             "torch's default" + (f", OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
                                  if "OMP_NUM_THREADS" in os.environ else ""))


def set_fp32_dots(value: str) -> None:
    """Make Triton compile fp32 dots at `value` in this process (sets TRITON_F32_DEFAULT, which Triton reads when it
    compiles a kernel and keys its on-disk cache by). "auto" changes nothing.

    Process-wide and one-way: a kernel compiled under one value is reused under another, so a process that already
    holds another value refuses (ValueError) rather than silently keeping the old kernels."""
    if value not in FP32_DOTS:
        raise ValueError(f"model.fp32_dots: '{value}' is not one of {list(FP32_DOTS)}")
    if value == "auto":
        return
    current = os.environ.get(FP32_DOTS_ENV)
    if current not in (None, value):
        raise ValueError(f"model.fp32_dots={value}: this process already compiles Triton's fp32 dots as "
                         f"{FP32_DOTS_ENV}={current}, and kernels compiled under it would be reused; start a new "
                         f"process, or make the two agree (model.fp32_dots=auto keeps {current})")
    if current is None:
        os.environ[FP32_DOTS_ENV] = value
        log.info("fp32 dots in Triton kernels: %s (%s)", value, FP32_DOTS_ENV)


def set_fp32_gemm_reduction(enabled: bool) -> None:
    """`model.fp32_gemm_reduction`: with `enabled`, cuBLAS may no longer reduce a bf16 GEMM's split-K partial sums in
    bf16 (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False; torch allows it by default),
    so every bf16 GEMM of the process accumulates in fp32 and rounds once. False changes nothing.

    Process-wide (torch reads the setting at every CUDA bf16 GEMM; CPU GEMMs do not read it): in a process where it
    is already off (a model built with it, or the caller), a model that asks for the default is refused
    (ValueError), since it would silently run with it off."""
    if not isinstance(enabled, bool):
        raise ValueError(f"model.fp32_gemm_reduction: expected true or false, got {enabled!r}")  # noqa: TRY004
    matmul = torch.backends.cuda.matmul
    if not enabled:
        if not matmul.allow_bf16_reduced_precision_reduction:
            raise ValueError("model.fp32_gemm_reduction=false: bf16 GEMMs' reduced-precision reduction is already "
                             "off in this process (torch.backends.cuda.matmul, process-wide: a model built with "
                             "model.fp32_gemm_reduction=true turns it off), so this model would run with it off too; "
                             "start a new process, or set model.fp32_gemm_reduction=true for both")
        return
    if matmul.allow_bf16_reduced_precision_reduction:
        matmul.allow_bf16_reduced_precision_reduction = False
        log.info("bf16 GEMMs reduce in fp32 (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction=False)")


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; `cpu`, `cuda`, `cuda:N` as given (cuda fails without CUDA)."""
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        reason = "auto: CUDA available" if device.type == "cuda" else "auto: no CUDA device"
    else:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
        reason = "as configured"
    log.info("device=%s (%s)", device, reason)
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> bf16 on CUDA (the checkpoint's dtype), fp32 on CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        reason = f"auto on {device.type}"
    else:
        dtype, reason = DTYPES[name], "as configured"
    log.info("dtype=%s (%s)", str(dtype).removeprefix("torch."), reason)
    return dtype


def triton_cache_dirs() -> dict[str, str] | None:
    """{entry: path} of the directories in Triton's kernel cache directory (`triton.knobs.cache.dir`:
    TRITON_CACHE_DIR, else ~/.triton/cache): one per compiled kernel variant, so entries that appear during a
    phase are kernels compiled in it. None without Triton or the directory."""
    try:
        import triton
        with os.scandir(triton.knobs.cache.dir) as entries:
            return {e.name: e.path for e in entries if e.is_dir()}
    except (ImportError, AttributeError, OSError):
        return None


def _kernel_name(path: str) -> str:
    """The kernel an entry of Triton's cache holds: the stem of its metadata file (<name>.json; the
    __grp__<name>.json index aside), or the entry's own name when it has none yet."""
    try:
        names = sorted(f[:-5] for f in os.listdir(path) if f.endswith(".json") and not f.startswith("__grp__"))
    except OSError:
        names = []
    return names[0] if names else os.path.basename(path)


def kernel_list(names: list[str], show: int = 6) -> str:
    """Kernel names for a log line: the first `show` distinct ones in order, a repeated one with its count
    ("chunk_fwd x2, k6, ..."); "..." when more are left out."""
    counts = Counter(names)
    shown = [f"{n} x{c}" if c > 1 else n for n, c in list(counts.items())[:show]]
    return ", ".join(shown) + (", ..." if len(counts) > show else "")


class CompileCounter:
    """Kernels Triton compiled between calls of `take` (the entries `triton_cache_dirs` gained): a step seconds
    slower than its neighbours with the same work, and compiles, waited on the compiler. Counts only when `enabled`
    (CUDA) and the cache is readable (`counting`); `take` then returns None, as it does from the moment the cache
    goes away (no figure rather than a wrong one). `names` holds the kernels of the last `take` that found some."""

    def __init__(self, enabled: bool):
        self.dirs = triton_cache_dirs() if enabled else None
        self.names: list[str] = []

    @property
    def counting(self) -> bool:
        return self.dirs is not None

    def take(self) -> int | None:
        if self.dirs is None:
            return None
        dirs = triton_cache_dirs()
        new = None if dirs is None else [path for name, path in dirs.items() if name not in self.dirs]
        self.dirs = dirs
        if new:
            self.names = sorted(_kernel_name(path) for path in new)
        return None if new is None else len(new)
