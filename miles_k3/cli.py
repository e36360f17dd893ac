"""The command line of an entry point: `hydra_app`, the decorator its `main` wears in place of `hydra.main`.

Before Hydra composes, every `key=value` (and `~key`) override on the command line is checked against the command's
schema (the dataclass registered as `<config_name>_schema`): a key that is not a field exits with one line naming it
and the closest field names (`field_hint`). Hydra's own message for it, "Could not override 'x'. To append to your
config use +x=...", is the wrong advice for a typed schema: an added key does nothing (`config.to_typed` refuses
it). The check runs on `sys.argv` before `hydra.main` because Hydra composes, and reports a failed composition and
exits, before any of our code runs (it has no error callback); the schema of a command is fixed, so no composition
is needed to know its fields. What the check cannot decide (a group such as recipe=, hydra.*, a free-form dict's
keys, a `+key` addition, a line Hydra cannot parse) is left to Hydra and to `to_typed`.

After Hydra has configured logging, the HTTP clients' per-request INFO lines (httpx and httpcore: one line per
request of an env=agent episode, thousands a step) are turned off (`quiet_http_logs`) unless hydra.verbose asks for
them.
"""
import argparse
import dataclasses
import difflib
import functools
import logging
import sys
import typing
from collections.abc import Callable
from importlib import resources
from typing import Any

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

RECIPES_MODULE = "miles_k3.recipes"
HTTP_LOGGERS = ("httpx", "httpcore")
"""Loggers that write one INFO line per HTTP request; WARNING in an entry point unless hydra.verbose names them."""


def hydra_app(prog: str, config_name: str) -> Callable[[Callable], Callable[[], None]]:
    """`@hydra_app("miles_k3.train", "train")` on `def main(raw: DictConfig)`: hydra.main over
    recipes/<config_name>.yaml, with the command line's override keys checked first (`check_overrides`) and the
    HTTP clients' request lines quieted once Hydra has configured logging (`quiet_http_logs`)."""
    def decorate(task: Callable) -> Callable[[], None]:
        @functools.wraps(task)  # Hydra names the job (train.log) after the unwrapped task's module
        def configured(raw) -> Any:
            quiet_http_logs()
            return task(raw)

        app = hydra.main(version_base=None, config_path=f"pkg://{RECIPES_MODULE}", config_name=config_name)(configured)

        @functools.wraps(task)
        def main() -> None:
            check_overrides(prog, config_name, sys.argv[1:], f" (python -m {prog} --help; --cfg job prints every "
                            "field)")
            app()
        return main
    return decorate


def check_overrides(prog: str, config_name: str, args: list[str], pointer: str) -> None:
    """Exit with `<prog>: <key>: not a field of <section>; did you mean ...?<pointer>` for the first override whose
    key is not a field of the command's schema (the schema `<config_name>_schema` must be registered)."""
    schema = OmegaConf.get_type(ConfigStore.instance().load(f"{config_name}_schema.yaml").node)
    groups = {p.name for p in resources.files(RECIPES_MODULE).iterdir() if p.is_dir() and p.name != "__pycache__"}
    for key in override_keys(args):
        if key in groups or key.split(".")[0] == "hydra" or "/" in key:
            continue  # a config group (recipe=NAME) or Hydra's own config: Hydra's to check
        hint = field_hint(schema, key)
        if hint is not None:
            raise SystemExit(f"{prog}: {hint}{pointer}")


def override_keys(args: list[str]) -> list[str]:
    """The keys that the command line's `key=value` and `~key` overrides set or delete (not `+key` additions, nor a
    `@package` override); [] when Hydra cannot parse the line (Hydra then says why)."""
    parser = get_args_parser()  # hydra.main's own parser: the same split of flags and overrides
    parser.exit_on_error = False
    try:
        known, _ = parser.parse_known_args(args)
        overrides = OverridesParser.create().parse_overrides(known.overrides)
    except (argparse.ArgumentError, HydraException):
        return []
    return [o.key_or_group for o in overrides if not (o.is_add() or o.is_force_add()) and o.package is None]


def field_hint(schema: type, key: str) -> str | None:
    """None when dotted `key` is a field of dataclass `schema` (walking into its sections; a free-form dict, or a
    value, ends the walk); else `<key>: not a field of <section>` with the closest names (`closest_fields`)."""
    parts = key.split(".")
    cls: Any = schema
    for i, name in enumerate(parts):
        fields = _fields(cls)
        if name not in fields:
            where = ".".join(parts[:i]) or "the config"
            what = "not a field of" if i == len(parts) - 1 else f"{'.'.join(parts[:i + 1])} is not a section of"
            return f"{key}: {what} {where}{did_you_mean(closest_fields(schema, key))}"
        cls = _section(fields[name])
        if not dataclasses.is_dataclass(cls):
            return None
    return None


def did_you_mean(names: list[str]) -> str:
    """'; did you mean a or b?' ('' for no names)."""
    return f"; did you mean {' or '.join(names)}?" if names else ""


def closest_fields(schema: type, key: str, n: int = 3) -> list[str]:
    """Up to `n` field paths of `schema` that dotted `key` (not one of them) most likely meant: the key with each
    unknown name respelt as the closest name at its level (rollout.prompt_per_step -> rollout.prompts_per_step);
    else the fields elsewhere named (about) as its last name (rollout.lr -> trainer.optim.lr); else the names
    closest to its first unknown one, in its section."""
    parts = key.split(".")
    respelt = _respell(schema, parts)
    if respelt is not None:
        return [respelt]
    paths = _paths(schema, "")
    names = difflib.get_close_matches(parts[-1], {p.rsplit(".", 1)[-1] for p in paths}, n=n, cutoff=0.8)
    elsewhere = [p for name in names for p in paths if p.rsplit(".", 1)[-1] == name]
    if elsewhere:
        return elsewhere[:n]
    cls, prefix = schema, ""
    for name in parts:
        if not dataclasses.is_dataclass(cls):
            return []
        fields = _fields(cls)
        if name not in fields:
            return [prefix + m for m in difflib.get_close_matches(name, fields, n=n)]
        cls, prefix = _section(fields[name]), f"{prefix}{name}."
    return []


def _respell(schema: type, parts: list[str]) -> str | None:
    """`parts` with each name that is not a field replaced by the closest field name at its level; None when one has
    no close name or the path does not end at a field."""
    cls: Any = schema
    out = []
    for i, name in enumerate(parts):
        if cls is dict:  # a free-form dict: its keys are the user's
            return ".".join(out + parts[i:])
        if cls is None:  # below a value
            return None
        fields = _fields(cls)
        if name not in fields:
            match = difflib.get_close_matches(name, fields, n=1)
            if not match:
                return None
            name = match[0]
        out.append(name)
        cls = _section(fields[name])
    return ".".join(out)


def _paths(cls: type, prefix: str) -> list[str]:
    """Every field path of dataclass `cls` (sections and values), depth first in declaration order."""
    out = []
    for name, tp in _fields(cls).items():
        out.append(prefix + name)
        section = _section(tp)
        if dataclasses.is_dataclass(section):
            out += _paths(section, f"{prefix}{name}.")
    return out


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> its resolved annotation."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _section(tp: Any) -> Any:
    """What a field of type `tp` holds below it: its dataclass (Optional[X] -> X); `dict` for a free-form dict or
    Any (any key); None for a value."""
    for t in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(t):
            return t
    if tp is Any or tp is dict or typing.get_origin(tp) is dict:
        return dict
    return None


def quiet_http_logs() -> None:
    """HTTP_LOGGERS at WARNING, unless hydra.verbose asked for them: hydra.verbose=true (the root logger at DEBUG)
    or a list naming one (Hydra set its level)."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
