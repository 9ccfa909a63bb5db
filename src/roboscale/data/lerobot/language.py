"""LeRobot 0.6's optional language annotation columns: ``language_persistent`` and ``language_events``.

Facts from LeRobot 0.6.1 (``datasets/language.py``, ``annotations/steerable_pipeline/writer.py``,
``docs/source/language_and_recipes.mdx``):

- both are data-parquet columns declared in info.json as ``{"dtype": "language", "shape": [1], "names": null}``;
  neither gets stats (``compute_stats`` skips the dtype);
- each cell is a list of rows ``{role, content, style, timestamp, camera, tool_calls}``. ``language_persistent``
  repeats the episode's whole list of persistent rows (subtask, plan, memory, motion, task_aug) on every frame, each
  row stamped with the time it became active; ``language_events`` holds, only on the frame where they fire, the
  event rows (interjection, vqa, trace, or a ``say`` tool call with no style), which carry no ``timestamp``;
- rows of the view-dependent styles (vqa, trace) name the ``observation.images.*`` feature they describe in
  ``camera``; rows of every other style leave it null;
- ``tool_calls`` is a list of OpenAI-style calls, typed ``list<json>`` (``list<string>`` on older pyarrow); the
  annotation writer lets pyarrow infer the struct types instead, so files carry either form.

Here a cell becomes a list of plain dicts (``tool_calls`` parsed from JSON when stored as text); ``cell_problems``
checks one cell; ``language_array`` builds a column to write (``tool_calls`` as JSON text, LeRobot's fallback type,
which every pyarrow and HF ``datasets`` reads).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from roboscale.utils.io import load_json

LANGUAGE_DTYPE = "language"
LANGUAGE_PERSISTENT = "language_persistent"
LANGUAGE_EVENTS = "language_events"
LANGUAGE_COLUMNS = (LANGUAGE_PERSISTENT, LANGUAGE_EVENTS)

PERSISTENT_FIELDS = ("role", "content", "style", "timestamp", "camera", "tool_calls")
EVENT_FIELDS = ("role", "content", "style", "camera", "tool_calls")

PERSISTENT_STYLES = frozenset({"subtask", "plan", "memory", "motion", "task_aug"})
EVENT_STYLES = frozenset({"interjection", "vqa", "trace"})
VIEW_DEPENDENT_STYLES = frozenset({"vqa", "trace"})
CAMERA_PREFIX = "observation.images."

Row = dict[str, Any]


def is_language(feature: Mapping[str, Any]) -> bool:
    return feature.get("dtype") == LANGUAGE_DTYPE


def fields_of(column: str) -> tuple[str, ...]:
    """The row fields of a language column (event rows have no ``timestamp``)."""
    return EVENT_FIELDS if column == LANGUAGE_EVENTS else PERSISTENT_FIELDS


def row_type(column: str) -> pa.StructType:
    """The Arrow struct of one row as we write it (LeRobot's canonical types, ``tool_calls`` as JSON text)."""
    types = {"role": pa.string(), "content": pa.string(), "style": pa.string(), "timestamp": pa.float32(),
             "camera": pa.string(), "tool_calls": pa.list_(pa.string())}
    return pa.struct([pa.field(name, types[name], nullable=name != "role") for name in fields_of(column)])


def arrow_type(column: str) -> pa.DataType:
    return pa.list_(row_type(column))


def hf_feature_json(column: str) -> dict[str, Any]:
    """The HF ``datasets`` description of a language column we write (``tool_calls`` elements are strings)."""
    value = {"dtype": "string", "_type": "Value"}
    row = {name: ({"feature": value, "_type": "List"} if name == "tool_calls" else
                  {"dtype": "float32", "_type": "Value"} if name == "timestamp" else value)
           for name in fields_of(column)}
    return {"feature": row, "_type": "List"}


# --------------------------------------------------------------------------------------------------- read


def _parsed_tool_calls(value: Any) -> Any:
    if value is None:
        return None
    return [load_json(call) if isinstance(call, str) else call for call in value]


def column_to_rows(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A language column as an object array [N] whose cells are lists of row dicts (an empty list for null)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    cells = array.to_pylist()
    out = np.empty(len(cells), dtype=object)  # filled one by one: np.array would stack equal-length lists into 2-D
    for i, cell in enumerate(cells):
        rows = []
        for row in cell or []:
            if isinstance(row, dict) and "tool_calls" in row:
                row = {**row, "tool_calls": _parsed_tool_calls(row["tool_calls"])}
            rows.append(row)
        out[i] = rows
    return out


def arrow_type_problem(actual: pa.DataType, column: str) -> str | None:
    """Why a parquet column type cannot hold ``column`` (None when it can): a list of structs with the column's row
    fields. Field types are not pinned (the annotation writer lets pyarrow infer them: float64 timestamps, null
    or struct ``tool_calls``); an all-null or empty column may be ``list<null>``."""
    if isinstance(actual, pa.ExtensionType):
        actual = actual.storage_type
    if not (pa.types.is_list(actual) or pa.types.is_large_list(actual)):
        return f"column type {actual} is not a list of annotation rows"
    item = actual.value_type
    if pa.types.is_null(item):
        return None
    if not pa.types.is_struct(item):
        return f"column type {actual} is not a list of annotation rows (structs)"
    names = [item.field(i).name for i in range(item.num_fields)]
    if sorted(names) != sorted(fields_of(column)):
        return f"annotation rows have fields {names}, LeRobot's {column} rows have {list(fields_of(column))}"
    return None


# --------------------------------------------------------------------------------------------------- check


def row_problem(row: Any, column: str, cameras: Collection[str]) -> str | None:
    """What is wrong with one row of ``column`` (None when nothing is): its fields and types, the column its style
    belongs in, and the camera rule (view-dependent styles name a camera feature, other styles none)."""
    if not isinstance(row, dict):
        return f"row is {type(row).__name__}, not an object"
    expected = fields_of(column)
    missing = [f for f in expected if f not in row]
    extra = [f for f in row if f not in expected]
    if missing or extra:
        return f"row fields {sorted(row)} differ from {list(expected)}"
    if not isinstance(row["role"], str) or not row["role"]:
        return f"'role' must be a non-empty string, got {row['role']!r}"
    for name in ("content", "style", "camera"):
        if row[name] is not None and not isinstance(row[name], str):
            return f"'{name}' must be a string or null, got {type(row[name]).__name__}"
    if column == LANGUAGE_PERSISTENT and (isinstance(row["timestamp"], bool)
                                         or not isinstance(row["timestamp"], (int, float))):
        return f"'timestamp' must be a number, got {row['timestamp']!r}"
    calls = row["tool_calls"]
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        return "'tool_calls' must be a list of objects or null"
    style = row["style"]
    if column == LANGUAGE_PERSISTENT and style in EVENT_STYLES or column == LANGUAGE_EVENTS and (
            style in PERSISTENT_STYLES):
        return f"style {style!r} belongs in {LANGUAGE_EVENTS if style in EVENT_STYLES else LANGUAGE_PERSISTENT}"
    if column == LANGUAGE_PERSISTENT and style is None:
        return "persistent rows need a style"
    if row["content"] is None and calls is None:
        return "row has neither 'content' nor 'tool_calls'"
    camera = row["camera"]
    if style in VIEW_DEPENDENT_STYLES:
        if not camera:
            return f"style {style!r} is view-dependent: 'camera' must name an {CAMERA_PREFIX}* feature"
        if not camera.startswith(CAMERA_PREFIX) or camera not in cameras:
            return f"'camera' is {camera!r}, not a camera feature of the dataset ({sorted(cameras)})"
    elif camera is not None:
        return f"style {style!r} is not view-dependent: 'camera' must be null, got {camera!r}"
    return None


def cell_problems(cell: Any, column: str, cameras: Collection[str]) -> list[str]:
    """Problems of one cell (a frame's list of rows), each naming the row."""
    if cell is None:
        return []
    if not isinstance(cell, list):
        return [f"must be a list of rows, got {type(cell).__name__}"]
    problems = []
    for i, row in enumerate(cell):
        problem = row_problem(row, column, cameras)
        if problem:
            problems.append(f"row {i}: {problem}")
    return problems


# --------------------------------------------------------------------------------------------------- write


def _stored_row(row: Mapping[str, Any], column: str) -> Row:
    out = {name: row.get(name) for name in fields_of(column)}
    if out["tool_calls"] is not None:
        out["tool_calls"] = [json.dumps(call, ensure_ascii=False) for call in out["tool_calls"]]
    return out


def language_array(cells: Sequence[Any], column: str) -> pa.Array:
    """The Arrow column of ``cells`` (one list of row dicts per frame; None is an empty list)."""
    stored = [[_stored_row(row, column) for row in (cell or [])] for cell in cells]
    return pa.array(stored, type=arrow_type(column))


# --------------------------------------------------------------------------------------------------- use


def active_row(persistent: Sequence[Row], t: float, style: str = "subtask") -> Row | None:
    """The persistent row of ``style`` in force at time ``t``: the latest one stamped at or before ``t`` (a
    subtask to prompt with, the current plan or memory); None before the first. Timestamps are float32 in the
    file, so ``t`` gets float32 slack."""
    slack = float(np.spacing(np.float32(max(abs(t), 1.0))))
    best = None
    for row in persistent:
        if row.get("style") == style and row["timestamp"] <= t + slack and (
                best is None or row["timestamp"] >= best["timestamp"]):
            best = row
    return best
