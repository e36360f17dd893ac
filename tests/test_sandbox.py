"""miles_k3.envs.sandbox: model-written Python in a separate process without network, environment or time to burn;
and the python tool on top of it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from miles_k3.envs import sandbox, tools
from miles_k3.envs.sandbox import (
    SandboxLimits,
    SandboxUnavailable,
    network_isolation_available,
    run_python,
)
from miles_k3.envs.tools import PythonTool, ToolCall, build_tools, run_tool_call

isolated = pytest.mark.skipif(
    not network_isolation_available(), reason="needs unprivileged user + network namespaces (unshare -rn)"
)


@pytest.mark.parametrize("field", ["cpu_s", "wall_s", "memory_mb", "output_bytes"])
def test_limits_validate(field):
    SandboxLimits().validate()
    with pytest.raises(ValueError, match=f"^env.python.{field}: must be > 0, got 0$"):
        SandboxLimits(**{field: 0}).validate()
    with pytest.raises(ValueError, match=f"env.python.{field}: must be > 0, got -1"):
        SandboxLimits(**{field: -1}).validate()


def test_without_isolation_nothing_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "network_isolation_available", lambda: False)
    with pytest.raises(SandboxUnavailable, match=r"`unshare -rn`") as unavailable:
        run_python("print('never')")
    assert "max_user_namespaces" in str(unavailable.value)
    with pytest.raises(SandboxUnavailable, match=r"`unshare -rn`"):
        PythonTool()
    with pytest.raises(SandboxUnavailable):
        build_tools(["calculator", "python"])
    assert list(tools.build_tools(["calculator"])) == ["calculator"]


@isolated
def test_prints():
    result = run_python('print("hi")')
    assert (result.stdout, result.stderr, result.exit_code, result.reason) == ("hi\n", "", 0, "ok")


@isolated
def test_environment_is_empty(monkeypatch):
    monkeypatch.setenv("MILES_K3_SANDBOX_MARKER", "parent")
    result = run_python("import os; print(len(os.environ)); print('MILES_K3_SANDBOX_MARKER' in os.environ)")
    count, marker = result.stdout.split()
    assert marker == "False" and int(count) <= 2, result.stdout


@isolated
def test_working_directory_is_a_removed_temp_dir():
    result = run_python("import os; print(os.getcwd()); open('scratch.txt', 'w').write('x')")
    workdir = Path(result.stdout.strip())
    assert result.reason == "ok" and workdir.is_absolute() and workdir != Path.cwd()
    assert not workdir.exists()


@isolated
def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from here
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as error:\n"
            "    print(type(error).__name__)\n"
        )
        result = run_python(code)
    assert result.reason == "ok"
    assert result.stdout.strip() in {"OSError", "ConnectionRefusedError", "TimeoutError"}, result.stdout


@isolated
def test_cpu_time_limit():
    start = time.monotonic()
    result = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=5))
    assert result.reason == "cpu time limit" and result.exit_code is not None
    assert time.monotonic() - start < 3


@isolated
def test_wall_time_limit():
    start = time.monotonic()
    result = run_python("import time; time.sleep(30)", SandboxLimits(wall_s=1))
    assert (result.reason, result.exit_code) == ("wall time limit", None)
    assert time.monotonic() - start < 3


@isolated
def test_memory_limit():
    result = run_python("x = bytearray(2_000_000_000)", SandboxLimits(memory_mb=256))
    assert not result.ok and result.reason == "memory limit"
    assert "MemoryError" in result.stderr


@isolated
def test_output_is_capped():
    result = run_python('print("x" * 100000)', SandboxLimits(output_bytes=1000))
    assert len(result.stdout) <= 1000 and result.stdout == "x" * 1000
    assert result.reason == "output truncated"


@isolated
def test_big_output_does_not_stall_or_fill_memory():
    code = "import sys\nfor _ in range(2000): sys.stdout.write('y' * 100000)\nsys.stderr.write('e' * 50000)"
    result = run_python(code, SandboxLimits(output_bytes=100))
    assert (len(result.stdout), len(result.stderr), result.reason) == (100, 100, "output truncated")


@isolated
def test_nonzero_exit():
    result = run_python("import sys; print('bye'); sys.exit(3)")
    assert (result.stdout, result.exit_code, result.reason) == ("bye\n", 3, "exit 3")


@isolated
def test_exception_exit_keeps_stderr():
    result = run_python("raise ValueError('bad')")
    assert result.reason == "exit 1" and result.stderr.rstrip().endswith("ValueError: bad")


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


@isolated
def test_background_children_are_killed_with_the_group():
    code = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('started')\n"
    )
    start = time.monotonic()
    result = run_python(code, SandboxLimits(wall_s=5))
    assert (result.stdout, result.reason) == ("started\n", "ok")
    # the sleeper holds stdout and stderr open: without the kill, each reader would wait out its 1 s join timeout
    assert time.monotonic() - start < 1.5
