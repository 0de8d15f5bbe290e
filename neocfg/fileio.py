"""Small-file I/O shared by plans, checkpoints and DPP positions: atomic writes and JSON reads with one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from neocfg.errors import DataError

T = TypeVar("T")


def write_text_atomic(path: Path, text: str) -> None:
    """A crash leaves the previous file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_json(path: Path, parse: Callable[[Any], T], missing: str, invalid: str) -> T:
    """parse(the file's JSON); a missing file is `<path>: <missing>`, a bad one `<path>: <invalid> (<why>)`."""
    path = Path(path)
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        raise DataError(f"{path}: {missing}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: {invalid} ({type(exc).__name__}: {exc})") from None
