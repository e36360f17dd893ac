"""docs/reference/config.md, generated from the config dataclasses and their attribute docstrings.

    python -m miles_k3.config_reference --write     # rewrite docs/reference/config.md
    python -m miles_k3.config_reference             # print it

Each command's config (`TrainConfig`, `EvalRunConfig`, `SFTConfig`, `ModelInfoConfig`, `InitCheckpointConfig`) is
one table of its fields; a field whose type is another config dataclass is a section, documented once in a table
of its own (linked). A field's documentation is the string literal right under it in the class body (an attribute
docstring, read with `ast`); a field without one is listed with an empty description.
`tests/commands/test_docs.py` checks that the committed file equals this module's output.
"""
import argparse
import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
import types
import typing
from pathlib import Path

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "reference" / "config.md"
REGENERATE = "python -m miles_k3.config_reference --write"


def commands() -> list[tuple[str, type]]:
    """(command, its config dataclass), in the order the reference lists them."""
    from miles_k3.config import EvalRunConfig, ModelInfoConfig, ServeConfig, TrainConfig
    from miles_k3.init_checkpoint import InitCheckpointConfig
    from miles_k3.sft_config import SFTConfig
    return [("python -m miles_k3.train", TrainConfig), ("python -m miles_k3.eval", EvalRunConfig),
            ("python -m miles_k3.sft", SFTConfig), ("python -m miles_k3.serve", ServeConfig),
            ("python -m miles_k3.model_info", ModelInfoConfig),
            ("python -m miles_k3.init_checkpoint", InitCheckpointConfig)]


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal that follows its annotated assignment in the class body (dedented,
    joined into one line); a field inherited from a dataclass base (ServeConfig's from the server's ServerConfig)
    has the docstring of the class that declares it."""
    docs = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs |= _own_attribute_docs(base)
    return docs | _own_attribute_docs(cls)


def _own_attribute_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def type_name(t) -> str:
    """A field's annotation as written in source: `int`, `str | None`, `list[str]`, `ModelConfig`."""
    if isinstance(t, str):
        return t
    if t is type(None):
        return "None"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None and args:
        name = getattr(origin, "__name__", str(origin).replace("typing.", ""))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _is_section(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def default_text(f: dataclasses.Field) -> str:
    """The field's default: its value's repr; a section's non-default values (`EvalConfig(samples=4)`); `—` when
    required."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        changed = _changed(value)
        return f"{type(value).__name__}({', '.join(changed)})" if changed else "(section defaults)"
    return repr(value)


def _changed(value) -> list[str]:
    """`name=value` of each field of a dataclass instance that differs from its class's own default (a section's
    own changed fields: `loss=LossConfig(tis='auto')`)."""
    try:
        plain = type(value)()
    except TypeError:
        return []
    return [f"{f.name}={_text(getattr(value, f.name))}" for f in dataclasses.fields(value)
            if getattr(value, f.name) != getattr(plain, f.name)]


def _text(value) -> str:
    return f"{type(value).__name__}({', '.join(_changed(value))})" if dataclasses.is_dataclass(value) else repr(value)


def class_doc(cls: type) -> str:
    """The class docstring in one line; '' where it has none (dataclasses then write a signature there)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(inspect.cleandoc(doc).split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _anchor(cls: type) -> str:
    return cls.__name__.lower()


def table(cls: type, prefix: str, sections: dict[type, str]) -> list[str]:
    """The rows of `cls`'s fields, named `prefix` + field; nested config dataclasses are added to `sections`
    (class -> the dotted name it was first met under) and linked."""
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        name = prefix + f.name
        if _is_section(t):
            sections.setdefault(t, name)
            kind = f"[{t.__name__}](#{_anchor(t)})"
        else:
            kind = f"`{_cell(type_name(t))}`"
        rows.append(f"| `{name}` | {kind} | `{_cell(default_text(f))}` | {_cell(docs.get(f.name, ''))} |")
    return rows


def render() -> str:
    """The whole reference, as docs/reference/config.md holds it."""
    out = [("<!-- Generated by `" + REGENERATE + "` from the config dataclasses' attribute docstrings; do not "
            "edit by hand. -->"), "", "# Config reference", "",
           ("Every field each command accepts, with its type, its dataclass default and its documentation. The "
           "defaults here are the dataclasses'; Hydra composes `recipes/` on top (`recipes/train.yaml` and the "
           "chosen `recipe=`), so a run may start from other values: `python -m miles_k3.train --cfg job` prints "
           "the composed config. Set a field with `name=value` (`trainer.optim.lr=5e-4`); a key a recipe does not "
           "set takes a `+`. An unknown key or a bad value fails before any work, naming the field."), ""]
    sections: dict[type, str] = {}
    for command, cls in commands():
        out += [f"## `{command}` ({cls.__name__})", "", class_doc(cls), ""]
        out += table(cls, "", sections) + [""]
    out += ["## Sections", "", ("Each section's fields, named as under `python -m miles_k3.train` where it occurs "
                                "there (the same section under another command takes the same fields)."), ""]
    done: set[type] = set()
    while len(done) < len(sections):
        cls = next(c for c in sections if c not in done)
        done.add(cls)
        doc = class_doc(cls)
        out += [f"### {cls.__name__}", "", f"`{sections[cls]}.*` ({cls.__module__}). {doc}".rstrip(), ""]
        out += table(cls, sections[cls] + ".", sections) + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m miles_k3.config_reference", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"write {DOC_PATH} instead of printing")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
