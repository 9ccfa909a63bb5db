"""The one interface evaluation and RL reach simulators through, and the registry of adapters.

An adapter is an ``EnvSpec``: how to name its tasks (suites included), the instruction a task gives the policy, how
to build an ``Env`` for one task with given cameras, its typed options and its defaults. ``Env.reset(seed, scene)``
alone fixes the initial state (``scene``: the episode's index among its task's initial states, for simulators that
ship a fixed list of them, as LIBERO does; the others place from ``seed``), so an episode is reproducible in
whichever process runs it; ``step(action)`` returns a ``Step``.

Adding a simulator is one module that defines an ``ENV_SPEC`` and one line in ``BUILTIN`` (or, without touching
this file, passing ``--env=package.module:SPEC_NAME``). See docs/architecture.md, "Adding an environment".
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from roboscale.errors import ConfigError
from roboscale.utils.imports import load


class Step(NamedTuple):
    observation: dict[str, Any]
    """``state`` (float32 [S]: what the policy sees), ``images`` ({camera name: H x W x 3 uint8})."""
    reward: float
    success: bool
    done: bool
    """The episode was cut off (time limit) or ended on its own."""
    info: dict[str, Any]


class Env(Protocol):
    task: str
    instruction: str
    """What the task asks in words (the policy's default prompt)."""
    camera_names: list[str]
    timings: dict[str, float]
    """Seconds spent so far in ``sim_s`` (physics) and ``render_s`` (cameras): the rollout engine's breakdown."""
    max_steps: int
    """The episode's step limit: ``step`` says ``done`` when it is reached (a cut-off, not an ending)."""

    def reset(self, seed: int, scene: int = 0) -> dict[str, Any]:
        """Start an episode: ``scene`` picks one of the task's fixed initial states where the simulator has them
        (LIBERO: init state ``scene mod 50``), ``seed`` everything else (MetaWorld: the whole placement)."""
        ...

    def step(self, action: Any, render: bool = True) -> Step:
        """``render=False``: the observation may leave ``images`` empty (nobody will look at them)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EnvRequest:
    """What a caller asks of the environments it builds (``EnvSpec.make(task, request)``): the same for every task
    of a run, so it travels once to each env worker."""

    image_size: int = 64
    """Height and width of every camera's frames (the policy's image size)."""
    cameras: dict[str, str] = field(default_factory=dict)
    """Dataset camera name (``observation.images.<name>``) -> the simulator's camera (``EnvSpec.sim_cameras``);
    empty: no images."""
    max_steps: int = 0
    """The episode's step limit (0: the adapter's limit for the task)."""
    state_feature: str = "observation.state"
    """The dataset feature the observation's ``state`` is (one of the spec's ``state_features``)."""
    options: Any = None
    """The adapter's own options: an instance of ``EnvSpec.options`` (``parse_options``), or None."""


@dataclass(frozen=True)
class EnvSpec:
    name: str
    make: Callable[[str, EnvRequest], Env]
    """``make(task, request) -> Env``: an environment of one task, as ``request`` asks."""
    resolve_tasks: Callable[[Sequence[str]], list[str]]
    """Task and suite names as a user writes them -> the env's task names (a ConfigError for unknown ones)."""
    instruction: Callable[[str], str]
    state_features: tuple[str, ...] = ("observation.state",)
    """The state features (dataset feature names) the env can give a policy as its observation's ``state``."""
    camera_aliases: dict[str, str] = field(default_factory=dict)
    """Dataset camera names -> the simulator's camera names, where they differ."""
    options: type | None = None
    """The adapter's own options (a dataclass: ``--env_options.NAME=VALUE``), or None when it has none."""
    default_tasks: tuple[str, ...] = ()
    """What runs when a user names no tasks."""
    default_cameras: dict[str, str] = field(default_factory=dict)
    """Dataset camera name -> simulator camera, for demonstrations when a user names none."""
    video_camera: str = ""
    """The camera evaluation videos show by default."""
    catalog: Callable[[], tuple[dict[str, str], dict[str, tuple[str, ...]]]] | None = None
    """Every task with its instruction, and the suites (``roboscale data tasks``)."""
    suite_groups: Callable[[], dict[str, tuple[str, ...]]] | None = None
    """The suites under headings (LIBERO: standard, then one heading per LIBERO-Pro perturbation), for
    ``roboscale data tasks``; None: one list."""
    variants: Callable[[list[str], list[str]], list[Any]] | None = None
    """``variants(standard_tasks, perturbations)``: the perturbed tasks of ``standard_tasks``, for ``eval
    --robustness``, as NamedTuples with the fields of ``roboscale.sim.libero_suites.Variant`` (task, perturbation,
    suite, standard, base_suite, description); ``perturbations`` picks some (empty: all). None: the adapter has
    no perturbed tasks."""
    experts: str = ""
    """``module:attribute`` of the adapter's ``ExpertSpec`` (``roboscale.sim.experts``: scripted demonstrations),
    imported only when demonstrations are generated; empty: the adapter has no experts."""

    def sim_cameras(self, names: Sequence[str]) -> dict[str, str]:
        return {name: self.camera_aliases.get(name, name) for name in names}

    def parse_options(self, raw: dict[str, Any] | Any) -> Any:
        """``raw`` (``--env_options`` as a mapping, or already an instance) as the adapter's options dataclass;
        an unknown or mistyped option is a ConfigError naming it."""
        from roboscale.config import from_dict

        if self.options is None:
            if raw:
                raise ConfigError(f"--env_options: the {self.name} environment takes no options, got {sorted(raw)}")
            return None
        if isinstance(raw, self.options):
            return raw
        return from_dict(self.options, dict(raw or {}), "--env_options")

    def tasks_or_default(self, names: Sequence[str]) -> list[str]:
        """``resolve_tasks(names)``, or the adapter's default tasks when ``names`` is empty."""
        return self.resolve_tasks(list(names) or list(self.default_tasks))


def expand_tasks(names: Sequence[str] | str, suite: Callable[[str], Sequence[str] | None],
                 task: Callable[[str], str]) -> list[str]:
    """Task and suite names as a user writes them (a list, or one string split at commas and spaces) -> task names,
    each once, in order: ``suite(name)`` gives a suite's tasks (None: not a suite), ``task(name)`` a task's own
    name (a ConfigError for an unknown one). Every adapter's ``resolve_tasks``."""
    if isinstance(names, str):
        names = [n for n in names.replace(",", " ").split() if n]
    tasks: list[str] = []
    for name in names:
        members = suite(name.lower())
        tasks.extend(members if members is not None else [task(name)])
    return list(dict.fromkeys(tasks))


def episode_seed(seed: int, task: str, attempt: int) -> int:
    """The seed ``reset`` places episode ``attempt`` of ``task`` with, from a run's base ``seed``: stable over
    processes and restarts (crc32, not ``hash()``), 31 bits. Every adapter's episodes are numbered by it
    (demonstrations, evaluation, RL), so their scenes never depend on which process runs them."""
    return (seed * 1_000_003 + zlib.crc32(task.encode()) + attempt * 7919) % (2**31 - 1)


BUILTIN: dict[str, str] = {"metaworld": "roboscale.sim.metaworld:ENV_SPEC", "libero": "roboscale.sim.libero:ENV_SPEC"}


def env_spec(name: str) -> EnvSpec:
    """The adapter registered as ``name``, or one given as ``module:attribute`` (imported lazily, also in the
    rollout workers, which receive only this name). A ``module:attribute`` must come from the user's command line
    or config file, never from a file a run reads (a checkpoint's config: ``roboscale.train.resume``)."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ConfigError(f"unknown environment {name!r}; registered: {sorted(BUILTIN)} "
                          "(or give an adapter as package.module:SPEC)")
    try:
        spec = load(target)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"environment {name!r}: cannot load {target} ({exc})") from None
    if not isinstance(spec, EnvSpec):
        raise ConfigError(f"environment {name!r}: {target} is a {type(spec).__name__}, not an EnvSpec")
    return spec
