"""Reading what evaluations leave on disk (protocol.json, episodes.jsonl, report.json, a training run's
evals.jsonl) so that a damaged file is a one-line ``DatasetError`` naming the file, the line and the field, not a
traceback from the code that uses it. Fields a reader does not know are accepted (a newer writer's)."""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from roboscale.errors import DatasetError
from roboscale.utils.io import load_json

Schema = Mapping[str, tuple[Any, ...]]
"""Field -> the types its value may have: int (not a bool), float (any number but a bool), bool, str, dict,
list, None."""

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
          list: "a list", None: "null"}


def _is(value: Any, kind: Any) -> bool:
    if kind is None:
        return value is None
    if isinstance(value, bool):  # JSON's true/false are Python ints too; they are never a count or a rate
        return kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def problem(record: Any, required: Schema, optional: Schema | None = None, prefix: str = "") -> str | None:
    """What is wrong with ``record`` (not an object, a required field missing, a field of the wrong type), or
    None. ``prefix`` names where the record sits in its file (``per_task.reach-v3.``)."""
    if not isinstance(record, dict):
        return f"{prefix.rstrip('.') + ' ' if prefix else ''}must be a JSON object, got {_shown(record)}"
    for name, kinds in {**required, **(optional or {})}.items():
        if name not in record:
            if name in required:
                return f"field {prefix + name!r} is missing"
        elif not any(_is(record[name], kind) for kind in kinds):
            return (f"field {prefix + name!r} must be {' or '.join(_NAMES[k] for k in kinds)}, "
                    f"got {_shown(record[name])}")
    return None


def dataclass_schema(cls: type) -> tuple[Schema, Schema]:
    """(required, optional) fields of a dataclass of JSON-able scalars, from its annotations: the record a
    ``to_dict`` of it wrote."""
    hints = typing.get_type_hints(cls)
    required: dict[str, tuple[Any, ...]] = {}
    optional: dict[str, tuple[Any, ...]] = {}
    for f in dataclasses.fields(cls):
        kinds = tuple(None if kind is type(None) else kind for kind in typing.get_args(hints[f.name]) or
                      (hints[f.name],))
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        (optional if has_default else required)[f.name] = kinds
    return required, optional


def read_json_object(path: Path, how_to_go_on: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ``how_to_go_on`` ends the error's message when it is not one."""
    suffix = f"; {how_to_go_on}" if how_to_go_on else ""
    try:
        data = load_json(Path(path).read_bytes())
    except FileNotFoundError:
        raise DatasetError(path, f"file not found{suffix}") from None
    except OSError as exc:
        raise DatasetError(path, f"cannot be read ({exc.strerror or exc}){suffix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(path, f"not valid JSON ({getattr(exc, 'msg', exc)}){suffix}") from None
    if not isinstance(data, dict):
        raise DatasetError(path, f"must hold a JSON object, got {_shown(data)}{suffix}")
    return data


def json_lines(path: Path, how_to_go_on: str = "") -> Iterator[tuple[int, Any]]:
    """(line number, value) of each complete line of a ``.jsonl`` file (none if it is missing). A last line
    without its newline is one a kill cut short, or one being written right now: skipped. A complete line that
    is not JSON was damaged: an error."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_bytes().decode(errors="replace").split("\n")
    for number, line in enumerate(lines[:-1], 1):  # lines[-1]: after the last newline, empty or torn
        if not line.strip():
            continue
        try:
            yield number, load_json(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(path, f"line {number}: not valid JSON ({exc.msg})"
                                     + (f"; {how_to_go_on}" if how_to_go_on else "")) from None
