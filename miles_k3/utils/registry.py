"""The one rule of the name -> function registries (policy losses, rewards, graders): a name belongs to one function.

A registry is a module-level dict filled by a decorator at import time, so the same module imported twice (by two
paths, or again in a worker process) registers the same function again: that is fine. Two different functions
under one name are a mistake (the later one would silently win), so they raise. "The same function" is compared by
its dotted name (module and qualified name), not by identity, because a re-imported module makes new objects.
"""
from __future__ import annotations

from collections.abc import Callable


def qualname(fn: Callable) -> str:
    """`module.qualified_name` of a function ("?" for a missing module; the object itself without a qualname)."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def check_unclaimed(kind: str, name: str, old: Callable | None, fn: Callable) -> None:
    """Raise ValueError when `name` is registered (`old`, None if not) to a function other than `fn`; `kind` names
    the registry in the message ("policy loss", "reward", ...)."""
    if old is not None and qualname(old) != qualname(fn):
        raise ValueError(f"{kind} '{name}' is already registered (by {qualname(old)}); pick another name")
