"""Prompt templates: how a problem's text becomes the prompt string the model is given, registered by name.

A template is a function `(problem: str, tokenizer) -> str` registered with `@register_template(name)`;
`render_prompt(name, problem, tokenizer)` applies one. Built in: `boxed` (the problem, then the instruction to
reason step by step and put the final answer in `\\boxed{}`), `plain` (the problem as it is), `chat` (the
boxed text as a user turn in the tokenizer's chat template, with the assistant turn opened) and `chat_plain`
(the problem as it is as that user turn, for datasets whose prompts carry their own instruction, such as
DAPO-Math-17k), and `equation` (an arithmetic expression without spaces, then "="). Templates return text,
not token ids: the caller tokenizes (without adding special tokens again). `response_text` is the other way:
an engine output's tokens as the text a grader reads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

Template = Callable[[str, Any], str]
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_TEMPLATES: dict[str, Template] = {}


def register_template(name: str) -> Callable[[Template], Template]:
    """Decorator: register `fn(problem, tokenizer) -> str` as template `name` (a name is registered once)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"template name must be a non-empty string, got {name!r}")

    def add(fn: Template) -> Template:
        if name in _TEMPLATES:
            raise ValueError(f"template '{name}' is already registered; pick another name")
        _TEMPLATES[name] = fn
        return fn

    return add


def template_names() -> list[str]:
    """The registered template names, sorted."""
    return sorted(_TEMPLATES)


def get_template(name: str) -> Template:
    """The template registered as `name`; ValueError listing the names when there is none."""
    try:
        return _TEMPLATES[name]
    except KeyError:
        raise ValueError(f"template: '{name}' is not one of {', '.join(template_names())}") from None


def render_prompt(name: str, problem: str, tokenizer: Any = None) -> str:
    """The prompt for `problem` under template `name` (`tokenizer` is needed by `chat` only)."""
    text = get_template(name)(problem, tokenizer)
    if not isinstance(text, str):
        raise TypeError(f"template '{name}' returned {type(text).__name__}, not a string; a template must "
                         "return the prompt text")
    return text


@register_template("boxed")
def boxed(problem: str, tokenizer: Any = None) -> str:
    """The problem, a blank line, then the step-by-step / `\\boxed{}` instruction."""
    return f"{problem}\n\n{BOXED_INSTRUCTION}"


@register_template("plain")
def plain(problem: str, tokenizer: Any = None) -> str:
    """The problem as it is."""
    return problem


@register_template("equation")
def equation(problem: str, tokenizer: Any = None) -> str:
    """The problem with all whitespace removed, then "=": "15 - 43 - 75" -> "15-43-75=" (compact prompts for
    arithmetic expressions, answered by the bare result)."""
    return "".join(problem.split()) + "="


@register_template("worked")
def worked(problem: str, tokenizer: Any = None) -> str:
    """"Compute step by step: {problem}" and a newline, where a worked solution's first line starts
    (`data.source=worked_sum`)."""
    return f"Compute step by step: {problem}\n"


@register_template("chat")
def chat(problem: str, tokenizer: Any = None) -> str:
    """The `boxed` text as the user turn of the tokenizer's chat template, ending with the assistant turn
    opened (`add_generation_prompt=True`)."""
    return _user_turn("chat", boxed(problem), tokenizer)


@register_template("chat_plain")
def chat_plain(problem: str, tokenizer: Any = None) -> str:
    """The problem as it is (it carries its own instruction) as the user turn of the chat template."""
    return _user_turn("chat_plain", problem, tokenizer)


def _user_turn(name: str, text: str, tokenizer: Any) -> str:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"template '{name}' needs a tokenizer with a chat template; this tokenizer has none: "
                         f"use template={'boxed' if name == 'chat' else 'plain'}")
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def response_text(tokenizer: Any, output: dict) -> str:
    """The text of an engine output (`output_ids`, `meta_info.finish_reason`) as graders see it: the tokens
    decoded with special tokens kept (K3's answer channel is marked by them), without the stop token that ended
    it ("6[EOS]" is the answer "6")."""
    ids = list(output["output_ids"])
    finish = output.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "stop" and isinstance(finish.get("matched"), int) and ids and ids[-1] == finish["matched"]:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)
