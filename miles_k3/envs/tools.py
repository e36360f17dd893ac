"""Tool calls in the policy's output, and the tools that answer them.

The policy calls a tool by writing, anywhere in its turn, Hermes-style spans

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>

`parse_tool_calls` returns every span in order, each a `ToolCall` or, when the span is malformed, a
`ToolCallError` naming the call's 1-based index and the problem; text outside the spans is ignored.
`run_tool_call` turns one call into the observation text and never raises for anything the model wrote: a bad span,
an unknown tool, or a tool refusing its input all become an "error: ..." observation.

Safety rules: nothing the model writes is ever eval'd or exec'd in this process. The calculator parses the
expression with `ast.parse` and walks the tree itself, accepting only numbers and + - * / // % ** and unary + -,
with bounds on length, exponents and magnitudes (so "9**9**9" cannot hang the trainer). The python tool runs code
only through `sandbox.run_python`: bubblewrap's namespaces (no processes, network or files of the host in view)
with CPU, memory, process, file-size, wall and output limits; it cannot even be constructed where that sandbox
cannot start.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import threading
from dataclasses import dataclass
from typing import Protocol

from miles_k3.envs import sandbox
from miles_k3.envs.sandbox import SandboxLimits, SandboxUnavailable

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_NAMES",
    "Calculator",
    "PythonTool",
    "SandboxUnavailable",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolFailure",
    "build_tools",
    "calculate",
    "parse_tool_calls",
    "run_tool_call",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_NAMES = ("calculator", "python")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call: the tool's name and its JSON-object arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    """A malformed tool-call span; `message` (e.g. "tool call 1: not JSON (...)") goes into the observation."""

    message: str


class ToolFailure(Exception):
    """A tool refused its input; the message becomes the observation."""


# ---------------------------------------------------------------------------------------------------------------
# Parsing


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every <tool_call>...</tool_call> span of `text`, in order, as a ToolCall or a ToolCallError; no span: []."""
    calls: list[ToolCall | ToolCallError] = []
    position = 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        index = len(calls) + 1
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end == -1:
            calls.append(
                ToolCallError(f"tool call {index}: {TOOL_CALL_OPEN} has no {TOOL_CALL_CLOSE} after it")
            )
            break
        calls.append(_parse_body(text[body_start:end], index))
        position = end + len(TOOL_CALL_CLOSE)
    return calls


def _parse_body(body: str, index: int) -> ToolCall | ToolCallError:
    """One span's body: a JSON object with a string "name" and an object "arguments" (missing: {})."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCallError(f"tool call {index}: not JSON ({error.msg} at char {error.pos})")
    except RecursionError:
        return ToolCallError(f"tool call {index}: not JSON (nested too deeply)")
    if not isinstance(payload, dict):
        return ToolCallError(f"tool call {index}: expected a JSON object, got {_json_type(payload)}")
    name = payload.get("name")
    if not isinstance(name, str):
        problem = "missing" if name is None else f"a {_json_type(name)}"
        return ToolCallError(f'tool call {index}: "name" must be a string, got {problem}')
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(f'tool call {index}: "arguments" must be an object, got {_json_type(arguments)}')
    return ToolCall(name=name, arguments=arguments)


def _json_type(value: object) -> str:
    """The JSON name of a decoded value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


# ---------------------------------------------------------------------------------------------------------------
# The calculator

MAX_EXPRESSION_CHARS = 200
"""The longest expression the calculator accepts."""
MAX_EXPONENT = 1000
"""The largest |exponent| of a power."""
MAX_MAGNITUDE = 1e100
"""The largest |value| of any literal, intermediate or result."""

_ALLOWED = "calculator: only numbers and + - * / // % ** ( ) are allowed"

_BINARY_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression safely (an AST walk, never eval) and return the result as text.

    ints print as ints ("14"), floats with repr ("3.5", "3.0"); anything outside numbers and + - * / // % ** and
    unary + -, or past the limits (length, exponent, magnitude), or a division by zero raises ToolFailure."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolFailure(f"calculator: expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as error:
        raise ToolFailure(f"calculator: syntax error in {expression!r}") from error
    try:
        value = _evaluate(tree.body)
    except (OverflowError, RecursionError) as error:
        raise ToolFailure(f"calculator: the result is too large (over {MAX_MAGNITUDE:g})") from error
    return repr(value) if isinstance(value, float) else str(value)


def _evaluate(node: ast.AST) -> float:
    """The value of one node of the allowed arithmetic tree, bounded in magnitude."""
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) not in (int, float):
            raise ToolFailure(f"{_ALLOWED}, got {type(value).__name__}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        return _UNARY_OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _bounded(_binary(node.op, left, right))
    kind = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolFailure(f"{_ALLOWED}, got {kind}")


def _binary(op: ast.operator, left: float, right: float) -> float:
    """Apply one allowed binary operator, refusing division by zero and oversized powers before computing."""
    if isinstance(op, (ast.Div, ast.FloorDiv)) and right == 0:
        raise ToolFailure("calculator: division by zero")
    if isinstance(op, ast.Mod) and right == 0:
        raise ToolFailure("calculator: modulo by zero")
    if isinstance(op, ast.Pow):
        _check_power(left, right)
    result = _BINARY_OPERATORS[type(op)](left, right)
    if isinstance(result, complex):
        raise ToolFailure("calculator: the result is not a real number")
    return result


def _check_power(base: float, exponent: float) -> None:
    """Refuse base ** exponent when |exponent| > MAX_EXPONENT, 0 ** negative, or |result| would pass MAX_MAGNITUDE."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolFailure(f"calculator: exponent {exponent!r} is over {MAX_EXPONENT} in magnitude")
    if base == 0:
        if exponent < 0:
            raise ToolFailure("calculator: division by zero (0 to a negative power)")
        return
    if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise ToolFailure(f"calculator: the result is too large (over {MAX_MAGNITUDE:g})")


def _bounded(value: float) -> float:
    """`value`, or ToolFailure when its magnitude is over MAX_MAGNITUDE (inf and nan included)."""
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise ToolFailure(f"calculator: the result is too large (over {MAX_MAGNITUDE:g})")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Tools


class Tool(Protocol):
    """A tool the policy can call: a name, a one-line description for the system prompt, and a call."""

    name: str
    description: str

    def __call__(self, arguments: dict, cancel: threading.Event | None = None) -> str:
        """The result text for `arguments`; raise ToolFailure on bad arguments. `cancel`, once set (from another
        thread: the step ran past env.step_timeout_s), asks a slow tool to stop at once."""
        ...


def _string_argument(tool: str, arguments: dict, key: str) -> str:
    """The one string argument `key` of `tool`; ToolFailure when it is missing, not a string, or has company."""
    extra = sorted(set(arguments) - {key})
    if extra:
        raise ToolFailure(
            f"{tool}: unexpected arguments {', '.join(map(repr, extra))}; it takes only {key!r}"
        )
    value = arguments.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in arguments else f"a {_json_type(value)}"
        raise ToolFailure(f"{tool}: argument {key!r} must be a string, got {got}")
    return value


class Calculator:
    """The "calculator" tool: arguments {"expression": str}, the value of the arithmetic expression."""

    name = "calculator"
    description = (
        'calculator: evaluates an arithmetic expression; arguments {"expression": str}, '
        "numbers with + - * / // % ** and parentheses"
    )

    def __call__(self, arguments: dict, cancel: threading.Event | None = None) -> str:
        """calculate(arguments["expression"]) (quick: `cancel` is not needed)."""
        return calculate(_string_argument(self.name, arguments, "expression"))


class PythonTool:
    """The "python" tool: arguments {"code": str}, run only via `sandbox.run_python` (bubblewrap, `limits`).

    The observation is the program's stdout as printed (not stripped: print(42) gives "42\\n"), followed, when it is
    not empty, by a "stderr: ..." line and, when the run was not ok, by an "exit: <reason>" line; stdout and stderr
    are each cut at `limits.output_bytes`. Raises SandboxUnavailable at construction where the sandbox cannot start."""

    name = "python"
    description = (
        "python: runs a Python 3 program (standard library only, no network, no input) and returns what it prints; "
        'arguments {"code": str}'
    )

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits if limits is not None else SandboxLimits()
        self.limits.validate()
        reason = sandbox.unavailable_reason()
        if reason is not None:
            raise SandboxUnavailable(reason)

    def __call__(self, arguments: dict, cancel: threading.Event | None = None) -> str:
        """The program's output (see the class docstring); `cancel` kills the run (observation "exit: cancelled")."""
        code = _string_argument(self.name, arguments, "code")
        try:
            result = sandbox.run_python(code, self.limits, cancel)
        except ValueError as error:
            raise ToolFailure(f"python: {error}") from error
        return _python_observation(result)


def _python_observation(result: sandbox.SandboxResult) -> str:
    """stdout, then "stderr: ..." when there is any, then "exit: <reason>" when the run was not ok."""
    text = result.stdout
    if result.stderr:
        text = _add_line(text, f"stderr: {result.stderr}")
    if result.reason != "ok":
        text = _add_line(text, f"exit: {result.reason}")
    return text


def _add_line(text: str, line: str) -> str:
    """`line` appended to `text` on a line of its own."""
    return text + ("" if not text or text.endswith("\n") else "\n") + line


_FACTORIES = {"calculator": Calculator, "python": PythonTool}


def build_tools(names: list[str], limits: SandboxLimits | None = None) -> dict[str, Tool]:
    """The named tools, in order, as {name: tool}; `limits` is the python tool's sandbox.

    ValueError for an unknown or repeated name; SandboxUnavailable for "python" where the sandbox cannot start."""
    tools: dict[str, Tool] = {}
    for name in names:
        if name not in _FACTORIES:
            raise ValueError(f"env.tools: {name!r} is not a tool; known: {', '.join(TOOL_NAMES)}")
        if name in tools:
            raise ValueError(f"env.tools: {name!r} is listed twice")
        tools[name] = PythonTool(limits) if name == "python" else _FACTORIES[name]()
    return tools


def run_tool_call(
    call: ToolCall | ToolCallError, tools: dict[str, Tool], cancel: threading.Event | None = None
) -> str:
    """The observation text for one call; never raises for anything the model wrote (errors become "error: ...").
    `cancel` is passed on to the tool."""
    if isinstance(call, ToolCallError):
        return f"error: {call.message}"
    tool = tools.get(call.name)
    if tool is None:
        available = ", ".join(tools) or "none"
        return f"error: unknown tool {call.name!r}; available: {available}"
    try:
        return tool(call.arguments, cancel)
    except ToolFailure as failure:
        return f"error: {failure}"
    except Exception as error:  # noqa: BLE001 - a tool's own bug must not end the episode
        return f"error: {call.name} failed: {type(error).__name__}: {error}"
