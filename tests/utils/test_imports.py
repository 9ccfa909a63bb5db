"""roboscale.utils.imports: the one ``package.module:attribute`` resolver."""

from __future__ import annotations

import pytest

from roboscale.utils.imports import is_code_name, load


@pytest.mark.parametrize("value", ["roboscale.sim.metaworld:ENV_SPEC", "planted:SPEC", "a.b_c:_d"])
def test_code_names(value: str) -> None:
    assert is_code_name(value)


@pytest.mark.parametrize("value", ["metaworld", "127.0.0.1:6379", "localhost:6379", "head-node:6379", "s3://bucket",
                                   "a:b:c", "a.:b", ":b", "a:", "a:b.c", 3, None, ["a:b"]])
def test_other_values_are_not_code_names(value: object) -> None:
    assert not is_code_name(value)


def test_load_imports_the_attribute_and_refuses_other_shapes() -> None:
    from roboscale.sim.env import BUILTIN

    assert load("roboscale.sim.env:BUILTIN") is BUILTIN
    with pytest.raises(ImportError, match="not a package.module:attribute name"):
        load("roboscale.sim.env")
    with pytest.raises(AttributeError):
        load("roboscale.sim.env:NOPE")
    with pytest.raises(ImportError):
        load("roboscale.no_such_module:X")
