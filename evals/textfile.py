"""User text files (data and responses, JSON / JSON Lines) read so that an error can name the file and the line.

`utf8_text(path, error)` decodes a file as UTF-8 and, on a bad byte, raises `error` naming the file, the 1-based
line and the byte; `numbered_lines(text)` numbers the lines of JSON Lines text split on "\\n" only: a JSON string
may hold U+2028, U+2029 or U+0085 raw (JSON escapes only control characters below U+0020), and
`str.splitlines()` would break a row there.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def utf8_text(path: Path, error: type[ValueError]) -> str:
    """The text of a UTF-8 file; anything else raises `error` naming the file, the 1-based line and the byte."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)  # 1-based, in bytes
        raise error(f"{path} line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {column} of the line: "
                    f"{e.reason}); save the file as UTF-8") from None


def numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of `text` split on "\\n" only (a trailing "\\r" stays: JSON reads it as
    whitespace)."""
    return enumerate(text.split("\n"), 1)
