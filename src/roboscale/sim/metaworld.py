"""MetaWorld environments with cheap headless rendering.

The gymnasium renderer MetaWorld ships with renders with 4x MSAA, shadows and reflections (~180 ms a frame on
llvmpipe); switching those off and rendering through our own ``mujoco.Renderer`` brings a 128² frame to ~10 ms
(see docs/architecture.md). We build the environment class directly instead of through ``gym.make`` so that each
episode can be seeded on its own: ``reset(seed)`` then gives the same object/goal placement whichever process
runs it, which is what makes parallel generation and evaluation reproducible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import time  # noqa: E402

import numpy as np  # noqa: E402

from roboscale.errors import ConfigError  # noqa: E402
from roboscale.sim.env import EnvRequest, EnvSpec, Step, expand_tasks  # noqa: E402
from roboscale.sim.rendering import CameraRenderer  # noqa: E402

TASK_DESCRIPTIONS: dict[str, str] = {
    "assembly-v3": "Pick up a nut and place it onto a peg",
    "basketball-v3": "Dunk the basketball into the basket",
    "bin-picking-v3": "Grasp the puck from one bin and place it into another bin",
    "box-close-v3": "Grasp the cover and close the box with it",
    "button-press-topdown-v3": "Press a button from the top",
    "button-press-topdown-wall-v3": "Bypass a wall and press a button from the top",
    "button-press-v3": "Press a button",
    "button-press-wall-v3": "Bypass a wall and press a button",
    "coffee-button-v3": "Push a button on the coffee machine",
    "coffee-pull-v3": "Pull a mug from a coffee machine",
    "coffee-push-v3": "Push a mug under a coffee machine",
    "dial-turn-v3": "Rotate a dial 180 degrees",
    "disassemble-v3": "Pick a nut out of a peg",
    "door-close-v3": "Close a door with a revolving joint",
    "door-lock-v3": "Lock the door by rotating the lock clockwise",
    "door-open-v3": "Open a door with a revolving joint",
    "door-unlock-v3": "Unlock the door by rotating the lock counter-clockwise",
    "drawer-close-v3": "Push and close a drawer",
    "drawer-open-v3": "Open a drawer",
    "faucet-close-v3": "Rotate the faucet clockwise",
    "faucet-open-v3": "Rotate the faucet counter-clockwise",
    "hammer-v3": "Hammer a screw on the wall",
    "hand-insert-v3": "Insert the gripper into a hole",
    "handle-press-side-v3": "Press a handle down sideways",
    "handle-press-v3": "Press a handle down",
    "handle-pull-side-v3": "Pull a handle up sideways",
    "handle-pull-v3": "Pull a handle up",
    "lever-pull-v3": "Pull a lever down 90 degrees",
    "peg-insert-side-v3": "Insert a peg sideways",
    "peg-unplug-side-v3": "Unplug a peg sideways",
    "pick-out-of-hole-v3": "Pick up a puck from a hole",
    "pick-place-v3": "Pick and place a puck to a goal",
    "pick-place-wall-v3": "Pick a puck, bypass a wall and place the puck",
    "plate-slide-back-side-v3": "Get a plate from the cabinet sideways",
    "plate-slide-back-v3": "Get a plate from the cabinet",
    "plate-slide-side-v3": "Slide a plate into a cabinet sideways",
    "plate-slide-v3": "Slide a plate into a cabinet",
    "push-back-v3": "Push the puck back to a goal",
    "push-v3": "Push the puck to a goal",
    "push-wall-v3": "Bypass a wall and push a puck to a goal",
    "reach-v3": "Reach a goal position",
    "reach-wall-v3": "Bypass a wall and reach a goal",
    "shelf-place-v3": "Pick and place a puck onto a shelf",
    "soccer-v3": "Kick a soccer into the goal",
    "stick-pull-v3": "Grasp a stick and pull a box with the stick",
    "stick-push-v3": "Grasp a stick and push a box using the stick",
    "sweep-into-v3": "Sweep a puck into a hole",
    "sweep-v3": "Sweep a puck off the table",
    "window-close-v3": "Push and close a window",
    "window-open-v3": "Push and open a window",
}

MT10 = (
    "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3",
    "drawer-close-v3", "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3",
)  # fmt: skip
# Pairs whose start scenes are nearly identical (mean abs pixel difference < 1 of 255 at 64²,
# benchmarks/start_frames.py; window-open/close differs by 4.4 and drawer-open/close by 1.5: the scene shows which):
# only the instruction tells the policy which one to do.
INSTRUCTION_PAIRS = (
    ("faucet-open-v3", "faucet-close-v3"),
    ("door-lock-v3", "door-unlock-v3"),
    ("handle-press-v3", "handle-pull-v3"),
    ("handle-press-side-v3", "handle-pull-side-v3"),
    ("push-v3", "push-back-v3"),
)
SUITES: dict[str, tuple[str, ...]] = {
    "mt10": MT10,
    "mt50": tuple(sorted(TASK_DESCRIPTIONS)),
    # The demo suite: the faucet pair (only the instruction tells them apart) plus two tasks with a visible cue.
    "demo": ("faucet-open-v3", "faucet-close-v3", "button-press-topdown-v3", "drawer-open-v3"),
    "pairs": tuple(task for pair in INSTRUCTION_PAIRS for task in pair),
}
# Camera positions/fixes. corner2 is moved where LeRobot puts it so the whole table is in view.
CAMERA_POSITIONS = {"corner2": (0.75, 0.075, 0.7)}
FLIPPED_CAMERAS = {"corner", "corner2"}  # these come out upside-down from MuJoCo
CAMERA_ALIASES = {"corner2": "corner2", "wrist": "gripperPOV"}

EPISODE_LIMIT = 250  # evaluation's default cut-off: experts need 35-180 steps on these tasks
STATE_DIM = 4  # hand xyz + gripper opening
FULL_STATE_DIM = 39  # MetaWorld's observation: hand, gripper, two object poses, the same a step before, the goal
# The state features a policy may read, as dataset feature names, and which part of the 39-d observation each is.
# observation.state is proprioception only; observation.environment_state is the whole observation MetaWorld's
# MT benchmarks give, goal included (the goal is a 1-2 px sphere at 64², so image-only policies cannot see it).
STATE_FEATURES = {"observation.state": slice(0, STATE_DIM),
                  "observation.environment_state": slice(0, FULL_STATE_DIM)}
ACTION_DIM = 4  # mocap delta xyz + gripper effort
FPS = 80  # MetaWorld control rate: frame_skip 5 x timestep 0.0025 s


def _task_name(name: str) -> str:
    full = name if name.endswith("-v3") else f"{name}-v3"
    if full not in TASK_DESCRIPTIONS:
        raise ConfigError(
            f"unknown MetaWorld task {name!r}; use one of the suites {sorted(SUITES)} "
            f"or a task name such as 'drawer-open' (all 50: `roboscale data tasks`)"
        )
    return full


def resolve_tasks(names: list[str] | tuple[str, ...] | str) -> list[str]:
    """Expand suite names (``mt10``, ``mt50``, ``demo``, ``pairs``) and accept task names with or without ``-v3``."""
    return expand_tasks(names, SUITES.get, _task_name)


def task_description(task: str) -> str:
    return TASK_DESCRIPTIONS[task]


@dataclass
class RenderConfig:
    """Cameras and image size for rendering. Names are our feature names; values are MuJoCo camera names."""

    height: int = 64
    width: int = 64
    cameras: dict[str, str] = field(default_factory=lambda: {"corner2": "corner2", "wrist": "gripperPOV"})


class MetaWorldEnv:
    """One MetaWorld task with cheap rendering and per-episode seeding.

    ``reset(seed)`` places objects and goal from ``seed`` alone. ``step`` returns the gymnasium 5-tuple; the
    observation is a dict with the 39-d ``full_state`` (what the scripted experts need), ``state`` (what policies
    see: the part of it ``state_feature`` names in ``STATE_FEATURES``) and ``images`` (``{feature_name: HxWx3
    uint8}``).
    """

    def __init__(self, task: str, render: RenderConfig | None = None, max_episode_steps: int = 500,
                 state_feature: str = "observation.state"):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        if state_feature not in STATE_FEATURES:
            raise ConfigError(f"state feature {state_feature!r} is not one MetaWorld gives; "
                              f"use one of {sorted(STATE_FEATURES)}")
        self._state_slice = STATE_FEATURES[state_feature]
        self.task = resolve_tasks([task])[0]
        self.instruction = task_description(self.task)
        self.render_config = render or RenderConfig()
        self.camera_names = list(self.render_config.cameras)
        self.timings = {"sim_s": 0.0, "render_s": 0.0}
        self.max_episode_steps = max_episode_steps
        env = ALL_V3_ENVIRONMENTS[self.task](render_mode=None)
        env._partially_observable = False  # goal in the 39-d obs: the experts need it
        env._freeze_rand_vec = False  # new object/goal placement on every reset...
        env.seeded_rand_vec = True  # ...drawn from the env's own seeded generator
        env._set_task_called = True
        del env.sawyer_observation_space  # cached_property; recomputed with the goal observable
        self._env = env
        model = env.model
        for camera, pos in CAMERA_POSITIONS.items():
            model.cam_pos[model.camera(camera).id] = pos
        self._renderer = None
        if self.render_config.cameras:
            self._renderer = CameraRenderer(model, self.render_config.height, self.render_config.cameras,
                                            _upright)
        self._steps = 0

    def _observation(self, full_state: np.ndarray, render: bool = True) -> dict:
        return {
            "full_state": full_state.astype(np.float64),
            "state": full_state[self._state_slice].astype(np.float32),
            "images": self.render() if render else {},
        }

    def render(self) -> dict[str, np.ndarray]:
        if self._renderer is None:
            return {}
        start = time.perf_counter()
        images = self._renderer.render(self._env.data)
        self.timings["render_s"] += time.perf_counter() - start
        return images
        start = time.perf_counter()
        images = self._renderer.render(self._env.data)
        self.timings["render_s"] += time.perf_counter() - start
        return images

    @property
    def max_steps(self) -> int:
        return self.max_episode_steps

    def reset(self, seed: int, scene: int = 0) -> dict:
        """The placement comes from ``seed`` alone (MetaWorld draws it; ``scene`` is for simulators with fixed
        initial states)."""
        start = time.perf_counter()
        self._env.seed(int(seed))
        full_state, _ = self._env.reset()
        self._steps = 0
        self.timings["sim_s"] += time.perf_counter() - start
        return self._observation(full_state)

    def step(self, action: np.ndarray, render: bool = True) -> Step:
        """``done`` is the time limit: MetaWorld episodes do not end on their own (success is a state that can
        be left again, so the caller decides whether success ends the episode). ``render=False``: no images
        (rendering costs ~10x the physics step; a caller that will not look at them skips it)."""
        start = time.perf_counter()
        action = np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
        full_state, reward, _, _, info = self._env.step(action)
        self._steps += 1
        success = bool(info.get("success", 0.0))
        truncated = self._steps >= self.max_episode_steps
        self.timings["sim_s"] += time.perf_counter() - start
        return Step(self._observation(full_state, render), float(reward), success, truncated, info)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self._env.close()

    def __enter__(self) -> MetaWorldEnv:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _upright(camera: str, image: np.ndarray) -> np.ndarray:
    return np.flip(image, (0, 1)) if camera in FLIPPED_CAMERAS else image


def make_env(task: str, request: EnvRequest) -> MetaWorldEnv:
    render = RenderConfig(request.image_size, request.image_size, dict(request.cameras))
    return MetaWorldEnv(task, render, max_episode_steps=request.max_steps or EPISODE_LIMIT,
                        state_feature=request.state_feature)


def catalog() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Every task with its instruction, and the suites."""
    return TASK_DESCRIPTIONS, SUITES


ENV_SPEC = EnvSpec("metaworld", make_env, resolve_tasks, task_description, camera_aliases=CAMERA_ALIASES,
                   state_features=tuple(STATE_FEATURES), default_tasks=("demo",),
                   default_cameras={"corner2": "corner2", "wrist": "gripperPOV"}, video_camera="corner2",
                   experts="roboscale.sim.metaworld_experts:EXPERTS", catalog=catalog)
