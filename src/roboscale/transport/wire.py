"""openpi's wire format: msgpack, with numpy arrays as maps, decoded strictly (both ends: `roboscale serve` and its
clients).

``openpi_client.msgpack_numpy`` (what ``WebsocketClientPolicy`` sends and expects) packs an ndarray as a map with
bytes keys ``__ndarray__`` (True), ``data`` (the raw bytes), ``dtype`` (``dtype.str``, e.g. ``"<f4"``) and
``shape``, and a numpy scalar as ``__npgeneric__`` / ``data`` (the item) / ``dtype``; everything else is plain
msgpack. We write the same maps. We read them from a network peer, so nothing in a message chooses what code runs:
no pickle (the ``msgpack-numpy`` package falls back to it for object arrays), no msgpack extension types, only
boolean, integer and float dtypes, and an array's bytes must be exactly what its dtype and shape say before any
array is made (a tiny message cannot declare a terabyte array).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

ARRAY_KINDS = "biuf"
"""numpy dtype kinds a peer may send: bool, signed and unsigned integers, floats (no objects, strings, voids,
complex)."""
MAX_DIMS = 8


class WireError(ValueError):
    """A message that is not openpi's msgpack-numpy, or holds what we do not accept (one line, for the peer)."""


@dataclass(frozen=True)
class WireLimits:
    """What one message from an untrusted peer may hold, checked by msgpack against each length header before
    anything is built, so a small message cannot make the reader build millions of objects (15 MiB of empty maps
    held a server's loop for 4 s) and a string cannot be larger than its reader will take."""

    max_str_bytes: int = 1 << 20
    max_array_len: int = 4096
    """Items of one msgpack array (a state sent as a list, an array's shape: arrays' data travel as bytes)."""
    max_map_len: int = 256
    option: str = ""
    """The option that sets ``max_str_bytes`` (named in the error)."""


def pack(obj: Any) -> bytes:
    """``obj`` (dicts, lists, numbers, strings, numpy arrays and scalars) as one msgpack message."""
    return msgpack.packb(obj, default=_pack_array)


def unpack(data: bytes, limits: WireLimits | None = None) -> Any:
    """One message back into Python and numpy objects; ``WireError`` naming what is wrong. ``limits``: what a
    message from an untrusted peer may hold (None: msgpack's own, for a peer we started)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"expected a binary msgpack message, got {type(data).__name__}")
    sizes = {} if limits is None else {"max_str_len": limits.max_str_bytes, "max_array_len": limits.max_array_len,
                                       "max_map_len": limits.max_map_len}
    try:
        return msgpack.unpackb(data, object_hook=_unpack_array, ext_hook=_refuse_ext, raw=False, **sizes)
    except WireError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # ExtraData, FormatError, StackError, ...
        if limits is not None and "max_str_len" in str(exc):
            raise WireError(f"a string in the message is longer than this server takes ({limits.max_str_bytes} "
                            f"bytes{', ' + limits.option if limits.option else ''})") from None
        if limits is not None and ("max_array_len" in str(exc) or "max_map_len" in str(exc)):
            raise WireError(f"the message holds an array or map longer than this server takes "
                            f"({limits.max_array_len} items, {limits.max_map_len} keys)") from None
        raise WireError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None


def _pack_array(obj: Any) -> Any:
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind not in ARRAY_KINDS:
        raise TypeError(f"cannot send a numpy array of dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send an object of type {type(obj).__name__}")


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} is not accepted")


def _dtype(value: Any) -> np.dtype:
    if not isinstance(value, str):
        raise WireError(f"an array's dtype must be a string such as '<f4', got {type(value).__name__}")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise WireError(f"unknown dtype {value!r}") from None
    if dtype.kind not in ARRAY_KINDS or dtype.names is not None or dtype.subdtype is not None:
        raise WireError(f"dtype {value!r} is not accepted (only bool, integer and float arrays)")
    return dtype


def _unpack_array(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if not isinstance(shape, list | tuple) or len(shape) > MAX_DIMS or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise WireError(f"an array's shape must be a list of at most {MAX_DIMS} sizes >= 0, got {shape!r}")
        if not isinstance(data, bytes):
            raise WireError(f"an array's data must be bytes, got {type(data).__name__}")
        expected = math.prod(shape) * dtype.itemsize
        if len(data) != expected:
            raise WireError(f"an array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes, "
                            f"got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    if b"__npgeneric__" in obj:
        dtype = _dtype(obj.get(b"dtype"))
        item = obj.get(b"data")
        if isinstance(item, bool | int | float):
            try:
                return dtype.type(item)
            except (OverflowError, ValueError):
                pass
        raise WireError(f"a numpy scalar of dtype {dtype.str} cannot hold {item!r}")
    return obj
