"""miles_k3.envs.tools: parsing tool calls, the safe calculator, building tools and answering calls."""

from __future__ import annotations

import pytest

from miles_k3.envs.tools import (
    TOOL_NAMES,
    Calculator,
    ToolCall,
    ToolCallError,
    ToolFailure,
    build_tools,
    calculate,
    parse_tool_calls,
    run_tool_call,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("7/2", "3.5"),
        ("6/2", "3.0"),
        ("2**10", "1024"),
        ("-3//2", "-2"),
        ("10%4", "2"),
        ("1.5*2", "3.0"),
        ("-2**2", "-4"),
        ("2**-1", "0.5"),
        ("+5 - -5", "10"),
        ("10**100", str(10**100)),
        (" 1 + 1 ", "2"),
    ],
)
def test_calculate(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('x')", "only numbers and + - * / // % ** ( ) are allowed, got Call"),
        ("a+1", "got Name"),
        ("True+1", "got bool"),
        ("'a'*3", "got str"),
        ("1j*2", "got complex"),
        ("2 < 3", "got Compare"),
        ("(1).real", "got Attribute"),
        ("[1][0]", "got Subscript"),
        ("lambda: 1", "got Lambda"),
        ("1 << 3", "got LShift"),
        ("~1", "got Invert"),
        ("2**100000", "exponent 100000 is over 1000"),
        ("9**9**9", "exponent 387420489 is over 1000"),
        ("10**101", "too large"),
        ("1e300", "too large"),
        ("1e60*1e60", "too large"),
        ("1/0", "division by zero"),
        ("1//0.0", "division by zero"),
        ("0**-1", "division by zero"),
        ("1%0", "modulo by zero"),
        ("(-8)**0.5", "not a real number"),
        ("x" * 201, "longer than 200 characters"),
        ("2 <", "syntax error"),
        ("", "syntax error"),
    ],
)
def test_calculate_refuses(expression, message):
    with pytest.raises(ToolFailure, match="^calculator: ") as failure:
        calculate(expression)
    assert message in str(failure.value)


def test_calculator_tool_arguments():
    calculator = Calculator()
    assert calculator({"expression": "1+1"}) == "2"
    for arguments, message in [
        ({}, "'expression' must be a string, got missing"),
        ({"expression": 3}, "'expression' must be a string, got a number"),
        ({"expression": "1", "x": 1}, "unexpected arguments 'x'"),
    ]:
        with pytest.raises(ToolFailure, match=message):
            calculator(arguments)


GOOD = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>'


def test_parse_no_span():
    assert parse_tool_calls("just an answer: 42") == []
    assert parse_tool_calls("") == []


def test_parse_two_spans_and_text_around():
    text = f'Let me compute. {GOOD} and then\n<tool_call> {{"name": "python"}} </tool_call> done.'
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2+3*4"}),
        ToolCall("python", {}),
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("", "tool call 2: not JSON (Expecting value at char 0)"),
        (
            "{'name': 'x'}",
            "tool call 2: not JSON (Expecting property name enclosed in double quotes at char 1)",
        ),
        ('["calculator"]', "tool call 2: expected a JSON object, got array"),
        ('{"arguments": {}}', 'tool call 2: "name" must be a string, got missing'),
        ('{"name": 3}', 'tool call 2: "name" must be a string, got a number'),
        (
            '{"name": "calculator", "arguments": "2+2"}',
            'tool call 2: "arguments" must be an object, got string',
        ),
        ('{"name": "calculator", "arguments": [1]}', 'tool call 2: "arguments" must be an object, got array'),
    ],
)
def test_parse_bad_span_is_an_error_with_its_index(body, message):
    calls = parse_tool_calls(f"{GOOD} text <tool_call>{body}</tool_call> {GOOD}")
    assert calls == [ToolCall("calculator", {"expression": "2+3*4"}), ToolCallError(message), calls[0]]
    assert run_tool_call(calls[1], build_tools(["calculator"])) == f"error: {message}"


def test_parse_unclosed_tag():
    calls = parse_tool_calls(f'{GOOD} <tool_call>{{"name": "calculator"}}')
    assert calls[1] == ToolCallError("tool call 2: <tool_call> has no </tool_call> after it")
    assert len(calls) == 2


def test_parse_deeply_nested_json_is_an_error():
    (call,) = parse_tool_calls("<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>")
    assert isinstance(call, ToolCallError) and call.message.startswith("tool call 1: ")


def test_run_tool_call_answers():
    tools = build_tools(["calculator"])
    (call,) = parse_tool_calls(GOOD)
    assert run_tool_call(call, tools) == "14"


@pytest.mark.parametrize(
    ("call", "observation"),
    [
        (ToolCall("search", {"q": "x"}), "error: unknown tool 'search'; available: calculator"),
        (ToolCall("calculator", {"expression": "1/0"}), "error: calculator: division by zero"),
        (ToolCall("calculator", {"expr": "1"}), "error: calculator: unexpected arguments 'expr'"),
        (ToolCallError("tool call 1: not JSON (x)"), "error: tool call 1: not JSON (x)"),
    ],
)
def test_run_tool_call_never_raises_for_model_mistakes(call, observation):
    assert run_tool_call(call, build_tools(["calculator"])).startswith(observation)


def test_run_tool_call_reports_a_tool_bug():
    class Broken:
        name = "broken"
        description = "broken: always fails"

        def __call__(self, arguments: dict, cancel=None) -> str:
            raise KeyError("boom")

    observation = run_tool_call(ToolCall("broken", {}), {"broken": Broken()})
    assert observation == "error: broken failed: KeyError: 'boom'"


def test_build_tools_names():
    assert TOOL_NAMES == ("calculator", "python")
    tools = build_tools(["calculator"])
    assert list(tools) == ["calculator"] and tools["calculator"].name == "calculator"
    assert "\n" not in tools["calculator"].description
    assert build_tools([]) == {}
    with pytest.raises(ValueError, match="env.tools: 'foo' is not a tool; known: calculator, python"):
        build_tools(["calculator", "foo"])
    with pytest.raises(ValueError, match="env.tools: 'calculator' is listed twice"):
        build_tools(["calculator", "calculator"])
