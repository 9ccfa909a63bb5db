"""Code named as ``package.module:attribute``: the one place such a name becomes an import.

Importing a module runs it, so a name reaches ``load`` only from the registries in our own code (policies, their
objectives and FP8 filters, environments) or from the user's own command line or config file (``--env=pkg.mod:SPEC``).
Nothing read from a checkpoint, dataset, lake or evaluation directory may name code that is imported: a resume
refuses a code name its checkpoint's config holds unless the command line gives it again
(``roboscale.train.resume``); ``is_code_name`` is how it recognises one.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# dotted.module.path:attribute, each part a Python identifier: exactly the shape `load` accepts.
_CODE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)


def is_code_name(value: Any) -> bool:
    """``value`` is a ``package.module:attribute`` string (a host:port or a URL is not)."""
    return isinstance(value, str) and _CODE_NAME.fullmatch(value) is not None


def load(name: str) -> Any:
    """The attribute ``name`` (``package.module:attribute``) names, importing its module. ImportError for a name
    of another shape or a module that does not import, AttributeError for an attribute the module lacks."""
    if not is_code_name(name):
        raise ImportError(f"{name!r} is not a package.module:attribute name")
    module, _, attribute = name.partition(":")
    return getattr(importlib.import_module(module), attribute)
