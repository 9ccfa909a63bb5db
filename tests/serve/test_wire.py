"""openpi's msgpack-numpy format: what we write reads back, and nothing a peer sends is trusted beyond plain data."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from roboscale.transport.wire import WireError, pack, unpack


def _array_map(data: bytes, dtype: str, shape: list) -> bytes:
    return msgpack.packb({"x": {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}})


def test_arrays_scalars_and_plain_values_round_trip_in_openpis_layout():
    message = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.uint8(7), "c": [1, "two", 3.0],
               "d": {"nested": np.array([True, False])}, "e": None}
    back = unpack(pack(message))
    assert back["a"].dtype == np.float32 and back["a"].shape == (2, 3) and np.array_equal(back["a"], message["a"])
    assert back["b"] == 7 and back["b"].dtype == np.uint8
    assert back["c"] == [1, "two", 3.0] and back["e"] is None and back["d"]["nested"].tolist() == [True, False]
    # the map openpi_client.msgpack_numpy writes: bytes keys, dtype.str, the shape as a list
    raw = msgpack.unpackb(pack({"a": np.zeros((2, 3), np.float32)}), raw=False)["a"]
    assert raw == {b"__ndarray__": True, b"data": bytes(24), b"dtype": "<f4", b"shape": [2, 3]}


@pytest.mark.parametrize("dtype", ["|O", "<U3", "|V8", "<c8", "|S4", "[('a', '<f4')]", "not-a-dtype"])
def test_object_string_void_and_complex_dtypes_are_refused(dtype):
    with pytest.raises(WireError, match="dtype"):
        unpack(_array_map(b"\0" * 8, dtype, [1]))


def test_an_array_must_carry_exactly_the_bytes_its_shape_declares():
    with pytest.raises(WireError, match="needs 4000000000000 bytes, got 4"):  # a terabyte declared in 4 bytes
        unpack(_array_map(b"\0" * 4, "<f4", [1000000, 1000000]))
    with pytest.raises(WireError, match="shape"):
        unpack(_array_map(b"", "<f4", [-1]))
    with pytest.raises(WireError, match="shape"):
        unpack(_array_map(b"", "<f4", [1] * 9))


def test_garbage_extension_types_and_text_are_not_messages():
    with pytest.raises(WireError, match="not a msgpack message"):
        unpack(b"\xc1\xc1\xc1")
    with pytest.raises(WireError, match="extension type 5"):
        unpack(msgpack.packb({"x": msgpack.ExtType(5, b"payload")}))
    with pytest.raises(WireError, match="binary"):
        unpack("a text frame")
    with pytest.raises(WireError, match="not a msgpack message"):
        unpack(msgpack.packb({1: 2}))  # non-string map keys


def test_objects_that_are_not_plain_data_cannot_be_sent():
    with pytest.raises(TypeError, match="object"):
        pack({"x": np.array([object()])})
    with pytest.raises(TypeError, match="set"):
        pack({"x": {1, 2}})
