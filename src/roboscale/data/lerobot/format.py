"""The LeRobot v3.0 on-disk format: constants, feature helpers, the metadata files, data columns as numpy.

Everything here mirrors what LeRobot 0.4.x writes (see ``tests/fixtures``, written by LeRobot itself), and reads
what 0.5/0.6 add to the same v3.0 format: ``language`` columns (``roboscale.data.lerobot.language``), depth-map
videos (``roboscale.data.lerobot.depth``), ``tools`` in info.json, info.json keys in 0.6's order:
``meta/info.json`` (indent 4, no trailing newline), ``meta/tasks.parquet`` (a pandas-style table whose index
column holds the task strings), ``meta/episodes/chunk-*/file-*.parquet`` and ``meta/stats.json``.
Readers are lenient about what Hub datasets carry; writers emit exactly one layout.
"""

from __future__ import annotations

import json
import logging
import re
import string
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from roboscale.data.lerobot import language
from roboscale.errors import DatasetError
from roboscale.utils.io import atomic_path, atomic_write_bytes, load_json

log = logging.getLogger(__name__)

CODEBASE_VERSION = "v3.0"

INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"

# The fields each path template may use: v3.0 info.json's, and the v2.x ones the converter reads.
DATA_PATH_FIELDS = ("chunk_index", "file_index")
VIDEO_PATH_FIELDS = ("video_key", "chunk_index", "file_index")
V2_DATA_PATH_FIELDS = ("episode_chunk", "episode_index")
V2_VIDEO_PATH_FIELDS = ("episode_chunk", "episode_index", "video_key")

DEFAULT_CHUNKS_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_MB = 100
DEFAULT_VIDEO_FILE_SIZE_MB = 200
DEFAULT_TOLERANCE_S = 1e-4  # LeRobot's tolerance_s: how far a timestamp may be from frame_index / fps

# The five columns every LeRobot dataset has; the writer adds them, users never declare them.
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}

STAT_KEYS = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
QUANTILES: dict[str, float] = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}

CAMERA_DTYPES = ("video", "image")

# info.json keys in the order LeRobot 0.4.x writes them (0.6 writes fps and features first, robot_type, splits and
# tools last; key order does not matter on read). Anything else is ignored on read, with one warning per file.
_INFO_KEY_ORDER = (
    "codebase_version",
    "robot_type",
    "total_episodes",
    "total_frames",
    "total_tasks",
    "chunks_size",
    "data_files_size_in_mb",
    "video_files_size_in_mb",
    "fps",
    "splits",
    "data_path",
    "video_path",
    "features",
    "tools",
)
_VERSION_RE = re.compile(r"^v(\d+)\.(\d+)$")
_WARNED_UNKNOWN: set[tuple[str, tuple[str, ...]]] = set()  # (info.json, its unknown keys) already warned about


# --------------------------------------------------------------------------------------------------- features


def is_camera(feature: Mapping[str, Any]) -> bool:
    return feature.get("dtype") in CAMERA_DTYPES


def image_hwc(feature: Mapping[str, Any]) -> tuple[int, int, int]:
    """(height, width, channels) of an image/video feature whose ``shape`` is HWC (recorder) or CHW (converters).

    ``names`` decides when it says where the channels are; otherwise a leading 1/3/4 with a larger last dim means CHW.
    """
    shape = tuple(int(s) for s in feature["shape"])
    if len(shape) != 3:
        raise ValueError(f"image shape must have 3 dims, got {list(shape)}")
    names = feature.get("names")
    if isinstance(names, (list, tuple)) and len(names) == 3 and all(isinstance(n, str) for n in names):
        if names[0].startswith("channel"):
            return shape[1], shape[2], shape[0]
        if names[2].startswith("channel"):
            return shape[0], shape[1], shape[2]
    if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4):
        return shape[1], shape[2], shape[0]
    return shape[0], shape[1], shape[2]


def feature_shape(feature: Mapping[str, Any]) -> tuple[int, ...]:
    """The per-frame array shape; cameras are normalised to HWC."""
    if is_camera(feature):
        return image_hwc(feature)
    return tuple(int(s) for s in feature["shape"])


def parquet_features(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Features that are columns of the data parquet: everything but videos, in declaration order."""
    return [k for k, f in features.items() if f["dtype"] != "video"]


def stats_features(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Features that get stats: every feature except strings and language annotations (as LeRobot 0.6)."""
    return [k for k, f in features.items() if f["dtype"] not in ("string", language.LANGUAGE_DTYPE)]


def _list_field(value_type: pa.DataType) -> pa.Field:
    return pa.field("element", value_type)


_IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])


def arrow_type(feature: Mapping[str, Any], key: str = "") -> pa.DataType:
    """The Arrow type LeRobot (through HF ``datasets``) uses for a non-video feature's data column."""
    dtype = feature["dtype"]
    if dtype == "image":
        return _IMAGE_STRUCT
    if dtype == "string":
        return pa.string()
    if dtype == language.LANGUAGE_DTYPE:
        return language.arrow_type(key)
    value_type = pa.from_numpy_dtype(np.dtype(dtype))
    shape = tuple(int(s) for s in feature["shape"])
    if shape == (1,):
        return value_type
    for dim in reversed(shape):
        value_type = pa.list_(_list_field(value_type), dim)
    return value_type


def hf_feature_json(feature: Mapping[str, Any], key: str = "") -> dict[str, Any]:
    """The HF ``datasets`` feature description stored in the data parquet's ``huggingface`` schema metadata."""
    dtype = feature["dtype"]
    if dtype == "image":
        return {"_type": "Image"}
    if dtype == "string":
        return {"dtype": "string", "_type": "Value"}
    if dtype == language.LANGUAGE_DTYPE:
        return language.hf_feature_json(key)
    shape = tuple(int(s) for s in feature["shape"])
    if shape == (1,):
        return {"dtype": dtype, "_type": "Value"}
    if len(shape) == 1:
        return {"feature": {"dtype": dtype, "_type": "Value"}, "length": shape[0], "_type": "List"}
    return {"shape": list(shape), "dtype": dtype, "_type": f"Array{len(shape)}D"}


def data_schema(features: Mapping[str, Mapping[str, Any]]) -> pa.Schema:
    keys = parquet_features(features)
    hf = {"info": {"features": {k: hf_feature_json(features[k], k) for k in keys}}}
    return pa.schema(
        [pa.field(k, arrow_type(features[k], k)) for k in keys], metadata={"huggingface": json.dumps(hf)}
    )


# --------------------------------------------------------------------------------------------------- info.json


@dataclass
class DatasetInfo:
    """``meta/info.json``. ``features`` is kept exactly as on disk (lists, not tuples) so a rewrite is byte-exact."""

    fps: int
    features: dict[str, dict[str, Any]]
    codebase_version: str = CODEBASE_VERSION
    robot_type: str | None = None
    total_episodes: int = 0
    total_frames: int = 0
    total_tasks: int = 0
    chunks_size: int = DEFAULT_CHUNKS_SIZE
    data_files_size_in_mb: Any = DEFAULT_DATA_FILE_SIZE_MB
    video_files_size_in_mb: Any = DEFAULT_VIDEO_FILE_SIZE_MB
    splits: dict[str, str] = field(default_factory=dict)
    data_path: str = DEFAULT_DATA_PATH
    video_path: str | None = None
    tools: list[Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _INFO_KEY_ORDER}
        if out["tools"] is None:
            del out["tools"]
        return out

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "video"]


def check_codebase_version(version: Any, path: Path) -> None:
    """v3.0 (and later v3.x, with a warning) is readable; v2.x must be converted; anything else is refused."""
    match = _VERSION_RE.match(version) if isinstance(version, str) else None
    if match is None:
        raise DatasetError(
            path, f"unknown codebase_version {version!r}; expected {CODEBASE_VERSION!r}", field="codebase_version"
        )
    major, minor = int(match[1]), int(match[2])
    if major < 3:
        raise DatasetError(
            path,
            f"dataset is in the old LeRobot {version} format; convert it to {CODEBASE_VERSION} first "
            f"(roboscale data convert {path.parent.parent} NEW_DIR)",
            field="codebase_version",
        )
    if major > 3:
        raise DatasetError(
            path, f"codebase_version {version!r} is newer than this reader ({CODEBASE_VERSION})",
            field="codebase_version",
        )
    if minor > 0:
        log.warning("%s: codebase_version %s is newer than %s; reading it as %s", path, version, CODEBASE_VERSION,
                    CODEBASE_VERSION)


def _check_features(features: Any, path: Path) -> None:
    if not isinstance(features, dict) or not features:
        raise DatasetError(path, "must be a non-empty object", field="features")
    for key, ft in features.items():
        if not isinstance(ft, dict) or not isinstance(ft.get("dtype"), str):
            raise DatasetError(path, "feature has no 'dtype'", field=key)
        shape = ft.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s > 0 for s in shape):
            raise DatasetError(path, f"feature 'shape' must be a list of positive ints, got {shape!r}", field=key)
        if is_camera(ft):
            try:
                image_hwc(ft)
            except ValueError as e:
                raise DatasetError(path, str(e), field=key) from None
        if language.is_language(ft) and key not in language.LANGUAGE_COLUMNS:
            raise DatasetError(path, f"dtype 'language' is for the columns {list(language.LANGUAGE_COLUMNS)} only",
                               field=key)


def read_info(root: str | Path) -> DatasetInfo:
    path = Path(root) / INFO_PATH
    try:
        raw = load_json(path.read_text())
    except FileNotFoundError:
        raise DatasetError(path, "not found; is this a LeRobot v3.0 dataset root?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(path, f"cannot read JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DatasetError(path, "must be a JSON object")
    check_codebase_version(raw.get("codebase_version"), path)
    unknown = tuple(sorted(set(raw) - set(_INFO_KEY_ORDER)))
    if unknown and (str(path.resolve()), unknown) not in _WARNED_UNKNOWN:
        _WARNED_UNKNOWN.add((str(path.resolve()), unknown))
        log.warning("%s: ignoring unknown keys %s", path, list(unknown))
    fps = raw.get("fps")
    if isinstance(fps, float) and fps.is_integer():
        fps = int(fps)
    if not isinstance(fps, int) or isinstance(fps, bool) or fps <= 0:
        raise DatasetError(path, f"must be a positive integer, got {fps!r}", field="fps")
    _check_features(raw.get("features"), path)
    for key in ("total_episodes", "total_frames"):
        if not isinstance(raw.get(key), int):
            raise DatasetError(path, f"must be an integer, got {raw.get(key)!r}", field=key)
    known = {k: raw[k] for k in _INFO_KEY_ORDER if k in raw}
    info = DatasetInfo(**known)
    root = path.parent.parent
    check_template(info.data_path, DATA_PATH_FIELDS, path, "data_path")
    dataset_path(root, info.data_path, "data_path", chunk_index=0, file_index=0)  # "../{chunk_index}": now
    if info.video_keys and not isinstance(info.video_path, str):
        raise DatasetError(path, "dataset has video features but no video_path template", field="video_path")
    if info.video_path is not None:
        check_template(info.video_path, VIDEO_PATH_FIELDS, path, "video_path")
    for key in info.video_keys:  # a camera's name is a directory of its videos: it must stay one
        dataset_path(root, info.video_path, "video_path", video_key=key, chunk_index=0, file_index=0)
    return info


# --------------------------------------------------------------------------------------------------- paths

# Values of the right type for each template field, to check a template's format specs before any real value.
_SAMPLE_VALUES: dict[str, Any] = {"video_key": "observation.images.cam", "chunk_index": 0, "file_index": 0,
                                  "episode_chunk": 0, "episode_index": 0}


def check_template(template: Any, fields: Collection[str], path: Path, key: str) -> str:
    """``template`` if it is a path template over ``fields`` alone, else a DatasetError naming ``path`` and ``key``.

    A template is metadata from the dataset: ``str.format`` would also evaluate attribute and index access
    (``{chunk_index.__class__}``), conversions and nested fields, so only plain field names with a format spec
    (``{chunk_index:03d}``) pass."""
    if not isinstance(template, str):
        raise DatasetError(path, f"must be a path template string, got {template!r}", field=key)
    names = ", ".join("{" + name + "}" for name in fields)
    allowed = f"a path template may use only {names}, each with a format spec such as :03d or none"
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:  # an unmatched brace
        raise DatasetError(path, f"{template!r} is not a path template ({e})", field=key) from None
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in fields or conversion is not None or "{" in (spec or ""):
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise DatasetError(path, f"{template!r} uses {shown}; {allowed}", field=key)
        try:
            format(_SAMPLE_VALUES[name], spec)
        except ValueError as e:
            raise DatasetError(path, f"{template!r}: bad format spec {spec!r} for {name} ({e})", field=key) from None
    return template


def relative_path(root: Path, template: str, key: str, **values: Any) -> str:
    """The path under ``root`` that ``template`` (info.json's field ``key``, already through ``check_template``)
    names for ``values``; a DatasetError unless it stays under ``root``: no absolute path, no ``..`` component.
    Checked on the text, so a symlink a user placed inside the dataset still works."""
    try:
        relative = template.format(**values)
    except (ValueError, TypeError):  # values of another type than info.json's spec expects (a damaged episodes table)
        raise DatasetError(root / INFO_PATH, f"the template {template!r} cannot be filled with {_shown(values)}",
                           field=key) from None
    if relative.startswith("/") or ".." in relative.split("/"):
        raise DatasetError(root / INFO_PATH, f"the template {template!r} gives {relative!r}, a path outside the "
                           f"dataset (for {_shown(values)})", field=key)
    return relative


def dataset_path(root: Path, template: str, key: str, **values: Any) -> Path:
    """``root / relative_path(...)``: the file of a dataset that info.json's template ``key`` names."""
    return root / relative_path(root, template, key, **values)


def referenced_file(root: Path, ref: str, path: Path, field: str | None = None) -> Path:
    """The file a data column of ``path`` refers to (an HF Image row's ``path``), which must lie under ``root``:
    a relative path without ``..`` (a dataset names no file of the machine that reads it)."""
    if ref.startswith("/") or ".." in ref.split("/"):
        raise DatasetError(path, f"refers to {ref!r}, outside the dataset (only relative paths inside it are read)",
                           field=field)
    return root / ref


def _shown(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def write_info(root: str | Path, info: DatasetInfo) -> None:
    # LeRobot's write_json: indent 4, no trailing newline.
    data = json.dumps(info.to_dict(), indent=4, ensure_ascii=False).encode()
    atomic_write_bytes(Path(root) / INFO_PATH, data)


def error_message(err: DatasetError) -> str:
    """The message of a DatasetError without its ``path: episode: field:`` prefix."""
    text = str(err)
    prefix = [str(err.path)]
    if err.episode is not None:
        prefix.append(f"episode {err.episode}")
    if err.field is not None:
        prefix.append(f"field {err.field!r}")
    head = ": ".join(prefix) + ": "
    return text[len(head):] if text.startswith(head) else text


def locate_error(err: DatasetError, *, field: str | None = None, episode: int | None = None) -> DatasetError:
    """``err`` with the field and episode filled in where the low-level code (a decoder, a file reader) could not
    know them; what it already names is kept."""
    return DatasetError(err.path, error_message(err), field=err.field if err.field is not None else field,
                        episode=err.episode if err.episode is not None else episode)


def timestamp_problem(timestamps: np.ndarray, frame_index: np.ndarray, fps: int, tolerance_s: float) -> str | None:
    """Why ``timestamps`` are not ``frame_index / fps`` within ``tolerance_s`` (None when they are).

    LeRobot stores float32 timestamps, whose rounding grows with the value (~2.4e-4 s at one hour), so one float32
    step of the expected value is allowed on top of the tolerance."""
    expected = frame_index.astype(np.float64) / fps
    allowed = tolerance_s + np.spacing(expected.astype(np.float32)).astype(np.float64)
    off = np.abs(timestamps.astype(np.float64) - expected)
    bad = off > allowed
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    return (f"{int(bad.sum())} timestamps differ from frame_index/fps by more than tolerance_s={tolerance_s} "
            f"(first at frame {int(frame_index[first])}: {float(timestamps[first]):.6f}s, expected "
            f"{expected[first]:.6f}s; largest gap {off.max():.6f}s)")


# --------------------------------------------------------------------------------------------------- parquet io


def _parquet_call(path: Path, fn: Callable[[], Any]) -> Any:
    """Run a pyarrow parquet call; a missing or corrupt file becomes a DatasetError naming it."""
    try:
        return fn()
    except FileNotFoundError:
        raise DatasetError(path, "file not found") from None
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(path, f"cannot read parquet: {e}") from None


def read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """Read a whole parquet file."""
    return _parquet_call(path, lambda: pq.read_table(path, columns=list(columns) if columns is not None else None))


def read_parquet_schema(path: Path) -> pa.Schema:
    return _parquet_call(path, lambda: pq.read_schema(path))


def open_parquet(path: Path) -> pq.ParquetFile:
    """Open a parquet file for row-group reads."""
    return _parquet_call(path, lambda: pq.ParquetFile(path))


def column_to_numpy(column: pa.ChunkedArray | pa.Array, feature: Mapping[str, Any], path: Path, key: str) -> Any:
    """A data column as numpy [N, *shape] in its stored dtype ([N] for scalar columns); images stay an Arrow
    struct array of PNG bytes, strings become an object array, language columns an object array of row lists."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if feature["dtype"] == "image":
        return array
    if feature["dtype"] == "string":
        return np.array(array.to_pylist(), dtype=object)
    if feature["dtype"] == language.LANGUAGE_DTYPE:
        return language.column_to_rows(array)
    n, nested = len(array), False
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(
        array.type
    ):
        array, nested = array.flatten(), True
    values = array.to_numpy(zero_copy_only=False)
    if not nested:
        return values
    shape = feature_shape(feature)
    if values.size != n * int(np.prod(shape)):
        raise DatasetError(path, f"column holds {values.size} values for {n} rows, expected shape {list(shape)} "
                                 "per row", field=key)
    return values.reshape((n, *shape))


# --------------------------------------------------------------------------------------------------- tasks


def _tasks_pandas_metadata() -> bytes:
    """pandas ``to_parquet`` metadata for a frame with a string index (the task) and an int64 ``task_index``."""
    meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [
            {"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "str",
             "metadata": {"encoding": "UTF-8"}}
        ],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": None, "field_name": "__index_level_0__", "pandas_type": "object", "numpy_type": "str",
             "metadata": None},
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "3.1.1",
    }
    return json.dumps(meta).encode()


TASKS_SCHEMA = pa.schema(
    [pa.field("task_index", pa.int64()), pa.field("__index_level_0__", pa.large_string())],
    metadata={"pandas": _tasks_pandas_metadata()},
)


def write_tasks(root: str | Path, tasks: Sequence[str]) -> None:
    """``tasks[i]`` is the task with ``task_index == i``."""
    table = pa.table(
        [pa.array(np.arange(len(tasks), dtype=np.int64)), pa.array(list(tasks), pa.large_string())],
        schema=TASKS_SCHEMA,
    )
    path = Path(root) / TASKS_PATH
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="snappy")


def _task_column(table: pa.Table) -> str:
    """The column holding the task strings: the pandas index column, or a plain ``task`` column."""
    meta = (table.schema.metadata or {}).get(b"pandas")
    if meta:
        for col in load_json(meta).get("index_columns", []):
            if isinstance(col, str) and col in table.column_names:
                return col
    for name in ("task", "__index_level_0__"):
        if name in table.column_names:
            return name
    raise KeyError("task")


def read_tasks(root: str | Path) -> list[str]:
    """Task strings ordered by task_index (which must be 0..n-1)."""
    path = Path(root) / TASKS_PATH
    table = read_parquet(path)
    if "task_index" not in table.column_names:
        raise DatasetError(path, "column missing", field="task_index")
    try:
        task_col = _task_column(table)
    except KeyError:
        raise DatasetError(path, "no task string column (pandas index or 'task')", field="task") from None
    indices = table["task_index"].to_numpy()
    names = table[task_col].to_pylist()
    order = np.argsort(indices, kind="stable")
    if not np.array_equal(indices[order], np.arange(len(indices))):
        raise DatasetError(path, f"task_index must be 0..{len(indices) - 1}, got {sorted(indices.tolist())}",
                           field="task_index")
    return [names[i] for i in order]


# --------------------------------------------------------------------------------------------------- episodes


def episodes_files(root: str | Path) -> list[Path]:
    return sorted((Path(root) / EPISODES_DIR).glob("*/*.parquet"))


class Episodes:
    """``meta/episodes`` as columns. ``eps[i]`` is the row of the i-th episode (a dict, like HF datasets);
    ``eps["dataset_from_index"]`` is a whole column (numpy for numbers, a list for ``tasks``)."""

    def __init__(self, columns: dict[str, Any]):
        self._columns = columns
        self._n = len(columns["episode_index"])

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            return self._columns[key]
        if not -self._n <= key < self._n:
            raise IndexError(key)
        return {k: (v[key].item() if isinstance(v, np.ndarray) else v[key]) for k, v in self._columns.items()}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(self._n))

    def __contains__(self, key: object) -> bool:
        return key in self._columns

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)


def read_episodes_table(root: str | Path, with_stats: bool = False) -> pa.Table:
    """All ``meta/episodes`` files concatenated, sorted by episode_index; ``stats/*`` columns dropped unless asked."""
    files = episodes_files(root)
    if not files:
        raise DatasetError(Path(root) / EPISODES_DIR, "no episodes parquet files found")
    tables = []
    for path in files:
        names = read_parquet_schema(path).names
        cols = [c for c in names if with_stats or not c.startswith("stats/")]
        table = read_parquet(path, cols)
        for required in ("episode_index", "length", "dataset_from_index", "dataset_to_index"):
            if required not in table.column_names:
                raise DatasetError(path, "column missing", field=required)
        tables.append(table)
    try:
        table = pa.concat_tables(tables, promote_options="default")
    except pa.ArrowException as e:
        raise DatasetError(files[0].parent.parent, f"episodes files have incompatible schemas: {e}") from None
    return table.sort_by("episode_index")


def table_to_episodes(table: pa.Table) -> Episodes:
    columns: dict[str, Any] = {}
    for name in table.column_names:
        col = table[name]
        if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            columns[name] = col.to_numpy()
        else:
            columns[name] = col.to_pylist()
    return Episodes(columns)


def read_episodes(root: str | Path) -> Episodes:
    return table_to_episodes(read_episodes_table(root))


def _stat_arrow_type(feature: Mapping[str, Any], stat: str) -> pa.DataType:
    """Per-episode stats column types, as LeRobot writes them (lists of float64; min/max keep int/bool dtypes)."""
    if stat == "count":
        return pa.list_(_list_field(pa.int64()))
    value = pa.float64()
    if stat in ("min", "max") and not is_camera(feature):
        kind = np.dtype(feature["dtype"]).kind
        value = {"i": pa.int64(), "u": pa.int64(), "b": pa.bool_()}.get(kind, pa.float64())
    depth = 3 if is_camera(feature) else len(feature["shape"])
    for _ in range(depth):
        value = pa.list_(_list_field(value))
    return value


def episodes_schema(features: Mapping[str, Mapping[str, Any]]) -> pa.Schema:
    fields = [
        pa.field("episode_index", pa.int64()),
        pa.field("tasks", pa.list_(_list_field(pa.string()))),
        pa.field("length", pa.int64()),
        pa.field("data/chunk_index", pa.int64()),
        pa.field("data/file_index", pa.int64()),
        pa.field("dataset_from_index", pa.int64()),
        pa.field("dataset_to_index", pa.int64()),
    ]
    for key, ft in features.items():
        if ft["dtype"] == "video":
            fields += [
                pa.field(f"videos/{key}/chunk_index", pa.int64()),
                pa.field(f"videos/{key}/file_index", pa.int64()),
                pa.field(f"videos/{key}/from_timestamp", pa.float64()),
                pa.field(f"videos/{key}/to_timestamp", pa.float64()),
            ]
    for key in stats_features(features):
        fields += [pa.field(f"stats/{key}/{s}", _stat_arrow_type(features[key], s)) for s in STAT_KEYS]
    fields += [pa.field("meta/episodes/chunk_index", pa.int64()), pa.field("meta/episodes/file_index", pa.int64())]
    return pa.schema(fields)


def episode_rows_to_table(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.Table:
    """Rows hold plain Python values (numpy stats already ``tolist()``-ed)."""
    return pa.Table.from_pylist(list(rows), schema=schema)


# --------------------------------------------------------------------------------------------------- stats.json


def _to_json_value(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def write_stats(root: str | Path, stats: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    obj = {k: {s: _to_json_value(v) for s, v in st.items()} for k, st in stats.items()}
    atomic_write_bytes(Path(root) / STATS_PATH, json.dumps(obj, indent=4, ensure_ascii=False).encode())


def read_stats(root: str | Path) -> dict[str, dict[str, np.ndarray]] | None:
    """``{feature: {stat: np.ndarray}}`` (``np.atleast_1d``), or None when the dataset has no stats.json."""
    path = Path(root) / STATS_PATH
    if not path.exists():
        return None
    try:
        raw = load_json(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(path, f"cannot read JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DatasetError(path, "must be a JSON object")
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, st in raw.items():
        if not isinstance(st, dict):
            raise DatasetError(path, "stats must be an object of stat -> list", field=key)
        out[key] = {s: np.atleast_1d(np.asarray(v)) for s, v in st.items()}
    return out
