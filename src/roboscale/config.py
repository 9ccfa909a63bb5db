"""Typed dataclass configs: YAML files plus dotted command-line overrides, and ``--help`` from field docs.

Every option is a dataclass field with a type, a default and a docstring (the string literal right after the
field). ``parse(Config, argv)`` reads ``--config file.yaml`` first, then applies ``--section.field=value``
overrides in order. A field typed as a registered base class (policies) is chosen with ``--policy.type=NAME``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import textwrap
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml

from roboscale.errors import ConfigError
from roboscale.utils.imports import load

T = TypeVar("T")

# Base config class -> {type name: subclass, or "module:Class" imported when first chosen}. A field annotated with a
# base class accepts a ``type`` key that selects the subclass (the draccus ChoiceRegistry pattern, without the
# dependency). Lazy entries keep start-up from importing every policy.
_CHOICES: dict[type, dict[str, type | str]] = {}


def register_lazy(base: type, name: str, path: str) -> None:
    """Make the class at ``path`` ("package.module:Class") selectable as ``type: name``; imported when chosen."""
    _CHOICES.setdefault(base, {})[name] = path


def _resolve(base: type, name: str) -> type:
    entry = _CHOICES[base][name]
    if isinstance(entry, str):
        entry = load(entry)
        entry.type = name
        _CHOICES[base][name] = entry
    return entry


def choices(base: type) -> dict[str, type]:
    return {name: _resolve(base, name) for name in _CHOICES.get(base, {})}


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (``x: int = 1`` followed by ``\"\"\"doc\"\"\"``)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise a ConfigError naming the option."""
    optional, inner = _is_optional(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional or value is None:
            return None
    tp = inner
    origin = typing.get_origin(tp)
    try:
        if dataclasses.is_dataclass(tp):
            if isinstance(value, tp):
                return value
            if isinstance(value, str) and tp in _CHOICES:
                value = {"type": value}  # a registered section named by its type alone (`--rl.algorithm=ppo`)
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping, got {value!r}")
            return from_dict(tp, value, where)
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        if tp in (int, float):
            if isinstance(value, bool):
                raise ValueError
            number = tp(value)
            if tp is float and not math.isfinite(number):  # no option means anything by NaN or infinity
                raise ConfigError(f"{where}: must be a finite number, got {value!r}")
            return number
        if tp is str:
            return str(value)
        if tp is Path:
            return Path(value)
        if origin in (list, tuple):
            if isinstance(value, str):
                value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
            (item,) = typing.get_args(tp)[:1] or (Any,)
            items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
        if origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value)
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a mapping, got {value!r}")
            kt, vt = typing.get_args(tp) or (Any, Any)
            return {_coerce(k, kt, where): _coerce(v, vt, f"{where}.{k}") for k, v in value.items()}
        if inspect.isclass(tp) and issubclass(tp, Enum):
            return tp(value)
        if tp is Any:
            return value
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: cannot read {value!r} as {getattr(tp, '__name__', tp)}") from None
    return value


def from_dict(cls: type[T], data: dict, where: str = "") -> T:
    """Build ``cls`` from a nested dict; unknown keys are errors (a typo must not be silently ignored)."""
    data = dict(data)
    if cls in _CHOICES:
        name = data.pop("type", None) or getattr(cls, "type", None)
        options = _CHOICES[cls]
        if not isinstance(name, str) or name not in options:
            raise ConfigError(f"{where or cls.__name__}.type: {name!r} is not one of {sorted(options)}")
        cls = _resolve(cls, name)
    else:
        data.pop("type", None)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown option(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}".lstrip(".")) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:  # a config's own check (__post_init__) names the option already
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def to_dict(cfg: Any) -> Any:
    """A JSON/YAML-ready nested dict, with ``type`` for registered configs."""
    if dataclasses.is_dataclass(cfg):
        out = {}
        if getattr(type(cfg), "type", None) is not None:
            out["type"] = type(cfg).type
        for f in dataclasses.fields(cfg):
            out[f.name] = to_dict(getattr(cfg, f.name))
        return out
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, Path):
        return str(cfg)
    if isinstance(cfg, Enum):
        return cfg.value
    return cfg


def flat_options(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A ``to_dict`` tree as {dotted option name: value}, the names the command line uses (``rl.epochs``)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_options(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        if isinstance(node.get(k), str):  # `--rl.algorithm=ppo --rl.algorithm.gamma=0.9`: the first named its type
            node[k] = {"type": node[k]}
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {k!r} is not a section")
    node[keys[-1]] = value


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            # Switching a registered section's type drops the old type's options.
            if "type" in v and v["type"] != out[k].get("type"):
                out[k] = dict(v)
            else:
                out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no", "on", "off")


def _arity(hints: dict[str, Any], key: str) -> str:
    """How many values ``--key v1 v2 ...`` takes: 'bool' (none, or one true/false), 'one', or 'many' (lists,
    and dotted keys, whose type this level does not know)."""
    if key == "config":
        return "one"
    if key not in hints:
        return "many"
    _, tp = _is_optional(hints[key])
    if tp is bool:
        return "bool"
    return "many" if typing.get_origin(tp) in (list, tuple) else "one"


def parse(cls: type[T], argv: list[str], defaults: T | None = None, prog: str = "roboscale",
          positional: tuple[str, ...] = ()) -> T:
    """``--config file.yaml`` then ``--a.b=value`` / ``--a.b value`` overrides; ``--help`` prints every option.

    ``positional``: fields that bare arguments fill, in order (one list field takes them all), as in
    ``roboscale lake build SRC... --output DIR``. ``--no-NAME`` sets a boolean field false."""
    if "-h" in argv or "--help" in argv:
        # the options of what the other arguments select (``--policy.type=groot --help`` lists GR00T's fields)
        rest = [a for a in argv if a not in ("-h", "--help")]
        try:
            shown = parse(cls, rest, defaults, prog, positional)
        except ConfigError:
            shown = defaults if defaults is not None else cls()
        print(help_text(cls, prog, shown, positional))
        raise SystemExit(0)
    base = to_dict(defaults if defaults is not None else cls())
    hints = _hints(cls)
    overrides: dict = {}
    loose: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            loose.append(arg)
            i += 1
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            key = key.replace("-", "_")
        else:
            key = arg[2:].replace("-", "_")
            arity = _arity(hints, key)
            values = []
            while i + 1 < len(args) and not args[i + 1].startswith("--"):
                nxt = args[i + 1]
                if (arity == "one" and values) or (arity == "bool" and (values or nxt.lower() not in _BOOL_WORDS)):
                    break  # what follows is a positional argument
                values.append(nxt)
                i += 1
            # `--tasks a b` gives a list; `--steps 5` a scalar; a bare flag switches a boolean on.
            value = values[0] if len(values) == 1 else (values or "true")
            if key.startswith("no_") and not values and _arity(hints, key[3:]) == "bool":
                key, value = key[3:], "false"
        if key == "config":
            path = Path(value)
            if not path.is_file():
                raise ConfigError(f"--config: {path} does not exist")
            try:
                loaded = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML ({exc})") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of options at the top level")
            base = _merge(base, loaded)
        else:
            _set_dotted(overrides, key, _parse_scalar(value) if isinstance(value, str) else value)
        i += 1
    if loose:
        _set_positional(overrides, loose, positional, hints, prog)
    return from_dict(cls, _merge(base, overrides))


def _set_positional(overrides: dict, values: list[str], positional: tuple[str, ...], hints: dict[str, Any],
                    prog: str) -> None:
    if not positional:
        raise ConfigError(f"unexpected argument {values[0]!r}; options look like --section.name=value (see --help)")
    if len(positional) == 1 and _arity(hints, positional[0]) == "many":
        overrides[positional[0]] = values
        return
    if len(values) != len(positional):
        raise ConfigError(f"{prog} takes {' '.join(p.upper() for p in positional)}, got {len(values)} arguments: "
                          f"{values}")
    overrides.update(zip(positional, values, strict=True))


def _parse_scalar(value: str) -> Any:
    """CLI strings stay strings unless they are JSON/YAML lists or mappings; _coerce converts by type later."""
    stripped = value.strip()
    if stripped[:1] in "[{":
        try:
            return yaml.safe_load(stripped)
        except yaml.YAMLError:
            return value
    return value


def help_text(cls: type, prog: str, value: Any = None, positional: tuple[str, ...] = ()) -> str:
    hints = _hints(cls)
    args = " ".join(f"{p.upper()}{'...' if _arity(hints, p) == 'many' else ''}" for p in positional)
    lines = [f"usage: {prog} {args + ' ' if args else ''}[--config FILE.yaml] [--option=value ...]", ""]
    doc = inspect.getdoc(cls)
    if doc:
        lines += [doc, ""]
    lines.append("options (defaults in brackets):")
    lines += _help_lines(cls, value if value is not None else cls(), "")
    lines.append("")
    lines.append("  --config FILE.yaml  read options from a YAML file first (same nesting as above)")
    return "\n".join(lines)


def _help_lines(cls: type, value: Any, prefix: str) -> list[str]:
    lines = []
    docs = field_docs(cls)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        current = getattr(value, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(current):
            sub = type(current)
            lines.append(f"  --{name}.*  {docs.get(f.name, '')}")
            base = next((b for b in _CHOICES if isinstance(current, b)), None)
            if base is not None:
                lines.append(f"  --{name}.type  one of {sorted(_CHOICES[base])} [{type(current).type}]")
            lines += _help_lines(sub, current, f"{name}.")
            continue
        tname = getattr(hints[f.name], "__name__", str(hints[f.name]).replace("typing.", ""))
        shown = json.dumps(to_dict(current)) if not isinstance(current, str) else current
        lines.append(f"  --{name}  ({tname}) {docs.get(f.name, '')} [{shown}]")
    return lines


def save_yaml(cfg: Any, path: str | Path) -> None:
    from roboscale.utils.io import atomic_write_bytes

    atomic_write_bytes(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
