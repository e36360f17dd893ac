"""Model-written Python, run in a separate, limited process: never in the training process, never in-process.

`run_python(code, limits)` runs `code` as

    unshare -rn <python> -I -S -c <bootstrap> <cpu> <cpu hard> <memory> <file size> <code>

- `unshare -rn`: a fresh user namespace and a fresh network namespace, so the child has no network at all (only a
  loopback interface that is down: even 127.0.0.1 in the parent's namespace is out of reach). Without unprivileged
  user + network namespaces (`network_isolation_available()` is False) nothing runs: `SandboxUnavailable`.
- `-I -S`: isolated mode (no PYTHON* variables, no user site, no script directory on sys.path) and no `site`, so
  only the standard library can be imported.
- The bootstrap is a fixed script (`_BOOTSTRAP`, no model text in it): it sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE
  and RLIMIT_CORE on itself and then `os.execv`s a fresh interpreter on the model's code (passed as argv data, never
  evaluated by the bootstrap); resource limits survive `execv`. The limits are set in the child rather than in a
  `preexec_fn` because `preexec_fn` is not safe in a parent with threads (a training process has many) and because
  `unshare` itself then starts unlimited.
- The environment is empty (`env={}`), stdin is /dev/null, the working directory is a fresh temporary directory
  removed afterwards, and the child leads a new session (process group): after `wall_s` the parent SIGKILLs the
  whole group, and it SIGKILLs the group once the child has exited too (stray background processes).
- stdout and stderr are read by two threads, each keeping at most `output_bytes` and discarding the rest, so a
  program printing gigabytes cannot fill the parent's memory; both are decoded as UTF-8 with errors="replace".

Not covered: the filesystem (the child runs as the same user and can read what the user can read, and write under
RLIMIT_FSIZE), and a descendant that leaves the process group with `setsid()` escapes the final kill (it keeps its
own CPU and memory limits).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, fields

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "network_isolation_available",
    "run_python",
]

FILE_SIZE_LIMIT_BYTES = 1 << 20
"""RLIMIT_FSIZE of the child: no file it writes grows past 1 MiB."""

MAX_CODE_BYTES = 100_000
"""The longest code `run_python` accepts: it travels as one argv string, which Linux caps at 128 KiB."""

_BOOTSTRAP = """\
import os, resource, sys
cpu, cpu_hard, memory, fsize = (int(arg) for arg in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu_hard))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", sys.argv[5]])
"""

UNAVAILABLE_MESSAGE = (
    "the python tool needs unprivileged user and network namespaces (`unshare -rn`, util-linux), and they are not "
    "available here; enable them (e.g. `sysctl kernel.unprivileged_userns_clone=1`, or `sysctl "
    "user.max_user_namespaces=<n>` with n > 0, and no seccomp/AppArmor policy blocking unshare), or leave the python "
    "tool off: model-written code is never run without them"
)
"""The message of SandboxUnavailable."""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one sandboxed run (the `env.python` config section)."""

    cpu_s: float = 5.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds; the hard limit is one second above)."""
    wall_s: float = 10.0
    """Wall-clock seconds, after which the parent kills the whole process group."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS)."""
    output_bytes: int = 16384
    """stdout and stderr are each cut to this many bytes."""

    def validate(self) -> None:
        """Raise ValueError naming the first field that is not > 0."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"env.python.{field.name}: must be > 0, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run printed and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The child's return code (negative: killed by that signal); None when the parent killed it at `wall_s`."""
    reason: str
    """"ok", "exit <code>", "cpu time limit", "wall time limit", "memory limit" or "output truncated"."""

    @property
    def ok(self) -> bool:
        """True when the code exited 0 within every limit, its output whole."""
        return self.reason == "ok"


class SandboxUnavailable(RuntimeError):
    """Unprivileged user and network namespaces are missing, so model-written code cannot run."""


@functools.cache
def _unshare_path() -> str | None:
    return shutil.which("unshare")


@functools.cache
def network_isolation_available() -> bool:
    """Whether `unshare -rn` works here (probed once: it runs this interpreter with `pass` in fresh namespaces)."""
    unshare = _unshare_path()
    if unshare is None:
        return False
    command = [unshare, "-rn", sys.executable, "-I", "-S", "-c", "pass"]
    try:
        probe = subprocess.run(
            command,
            check=False,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a separate, limited, network-less process (see the module docstring) and return its output.

    Raises SandboxUnavailable without `unshare -rn`, ValueError for bad limits or code that cannot be passed on
    (a NUL character, more than MAX_CODE_BYTES)."""
    limits.validate()
    if not network_isolation_available():
        raise SandboxUnavailable(UNAVAILABLE_MESSAGE)
    if "\0" in code:
        raise ValueError("code contains a NUL character")
    if len(code.encode("utf-8", errors="surrogatepass")) > MAX_CODE_BYTES:
        raise ValueError(f"code is longer than {MAX_CODE_BYTES} bytes")
    with tempfile.TemporaryDirectory(prefix="miles_k3_sandbox_", ignore_cleanup_errors=True) as workdir:
        proc = subprocess.Popen(
            _command(code, limits),
            env={},
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        readers = [
            _CappedReader(proc.stdout, limits.output_bytes),
            _CappedReader(proc.stderr, limits.output_bytes),
        ]
        for reader in readers:
            reader.start()
        try:
            exited = _wait_for_exit(proc.pid, limits.wall_s)
        finally:
            _kill_group(proc.pid)
            returncode, cpu_used = _reap(proc)
        for reader in readers:
            reader.join(timeout=1.0)
    stdout, stderr = (reader.text() for reader in readers)
    truncated = any(reader.truncated for reader in readers)
    exit_code = returncode if exited else None
    reason = _reason(exit_code, cpu_used, stderr, truncated, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, reason=reason)


def _command(code: str, limits: SandboxLimits) -> list[str]:
    cpu = _cpu_soft_limit(limits)
    memory = int(limits.memory_mb) * (1 << 20)
    limit_args = [str(cpu), str(cpu + 1), str(memory), str(FILE_SIZE_LIMIT_BYTES)]
    return [
        _unshare_path() or "unshare",
        "-rn",
        sys.executable,
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        *limit_args,
        code,
    ]


def _cpu_soft_limit(limits: SandboxLimits) -> int:
    return max(1, math.ceil(limits.cpu_s))


class _CappedReader(threading.Thread):
    """Reads one pipe to its end, keeping the first `limit` bytes and discarding the rest."""

    def __init__(self, stream, limit: int) -> None:
        super().__init__(daemon=True)
        self._stream = stream
        self._limit = limit
        self._data = bytearray()
        self._lock = threading.Lock()
        self.truncated = False

    def run(self) -> None:
        fd = self._stream.fileno()
        try:
            with contextlib.suppress(OSError):
                while chunk := os.read(fd, 65536):
                    self._keep(chunk)
        finally:
            self._stream.close()

    def _keep(self, chunk: bytes) -> None:
        with self._lock:
            room = self._limit - len(self._data)
            if len(chunk) > room:
                self.truncated = True
            self._data += chunk[: max(room, 0)]

    def text(self) -> str:
        with self._lock:
            return bytes(self._data).decode("utf-8", errors="replace")


def _wait_for_exit(pid: int, wall_s: float) -> bool:
    """Poll until the child has exited (left a zombie, not reaped) or `wall_s` has passed; True if it exited."""
    deadline = time.monotonic() + wall_s
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.02)
    return True


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's process group; the unreaped leader keeps the id from being reused meanwhile."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _reap(proc: subprocess.Popen) -> tuple[int, float]:
    """Reap the (killed or exited) child: its return code and the CPU seconds it used."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _reason(
    exit_code: int | None, cpu_used: float, stderr: str, truncated: bool, limits: SandboxLimits
) -> str:
    if exit_code is None:
        return "wall time limit"
    if exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_used >= _cpu_soft_limit(limits)):
        return "cpu time limit"
    if exit_code in (-signal.SIGKILL, -signal.SIGSEGV) or (exit_code != 0 and _ends_in_memory_error(stderr)):
        return "memory limit"
    if exit_code != 0:
        return f"exit {exit_code}"
    if truncated:
        return "output truncated"
    return "ok"


def _ends_in_memory_error(stderr: str) -> bool:
    lines = stderr.strip().splitlines()
    return bool(lines) and lines[-1].startswith("MemoryError")
