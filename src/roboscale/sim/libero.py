"""LIBERO (Liu et al., 2023) behind the ``Env`` protocol, in LeRobot's conventions.

What a policy sees is what LeRobot's LIBERO env and processor give one (``lerobot/envs/libero.py``,
``processor/env_processor.py``, 0.4.4), so a policy trained on LeRobot's LIBERO datasets runs unchanged:

================  =========================================  ==============================================
ours              LeRobot                                    from robosuite
================  =========================================  ==============================================
``image``         ``observation.images.image``               ``agentview`` camera, rotated 180 degrees
``image2``        ``observation.images.image2`` (wrist)      ``robot0_eye_in_hand``, rotated 180 degrees
``state`` (8)     ``observation.state``                      eef position (3), eef axis-angle (3), gripper
                                                             finger positions (2)
action (7)        ``action``                                 OSC_POSE deltas in [-1, 1]: xyz, rotation, gripper
                                                             (-1 open, +1 closed); the no-op is 0,...,0,-1
================  =========================================  ==============================================

"Rotated 180 degrees" is LeRobot's flip of both image axes applied to robosuite's frames, which come out of OpenGL
bottom row first; we render with ``mujoco.Renderer`` (top row first), so the same picture is our frame mirrored
left-right. Episode ``scene`` starts from the task's official init state ``scene mod 50``, then ``settle_steps``
no-op steps let the objects settle (LeRobot and openpi wait 10). Limits per suite are LeRobot's.

Cost (benchmarks/libero_step.py, docs/benchmarks.md): robosuite's own path renders both cameras after every control
step, 154 ms a step on 2 CPU cores (llvmpipe) against 14 ms of physics (25 substeps of OSC control). Cameras here
are rendered only when the policy looks (``render=True``: once a chunk in the rollout engine), without shadows,
reflections or multisampling. Resets are soft: the XML is loaded once per env, not per episode (117 ms against
2.9 s). The one state a soft reset keeps, the gripper's last command, is cleared, so an episode's trajectory is the
same in a fresh env, a reused one, or another process.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

import time  # noqa: E402

import numpy as np  # noqa: E402

from roboscale.errors import ConfigError  # noqa: E402
from roboscale.sim.env import EnvRequest, EnvSpec, Step  # noqa: E402
from roboscale.sim.libero_suites import (  # noqa: E402
    catalog, instruction, resolve_tasks, suite_groups, task_info, variants,
)
from roboscale.sim.rendering import CameraRenderer  # noqa: E402

CAMERAS = {"image": "agentview", "image2": "robot0_eye_in_hand"}  # LeRobot's names -> robosuite's cameras
CAMERA_ALIASES = {**CAMERAS, "wrist": "robot0_eye_in_hand"}
STATE_DIM = 8
ACTION_DIM = 7
NO_OP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float32)
FPS = 20  # robosuite's control frequency in LIBERO
INIT_STATES_PER_TASK = 50


@dataclass
class LiberoOptions:
    """LIBERO's options (``--env_options.NAME=VALUE``)."""

    settle_steps: int = 10
    """No-op steps after the init state is set, before the episode starts (objects settle; LeRobot's 10)."""

    def __post_init__(self) -> None:
        if self.settle_steps < 0:
            raise ConfigError(f"--env_options.settle_steps must be >= 0, got {self.settle_steps}")


def load_init_states(path: Path) -> np.ndarray:
    """A task's init states [50, D] from LIBERO's ``.npz`` (numeric arrays only: nothing pickled is loaded)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            states = archive["states"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a LIBERO init-state file ({type(exc).__name__}: {exc})") from None
    if states.ndim != 2 or states.dtype.kind != "f" or not np.isfinite(states).all():
        raise ConfigError(f"{path}: expected finite float init states [N, D], got {states.dtype} {states.shape}")
    return states


def axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """robosuite's quaternion (x, y, z, w) as an axis-angle vector, as LeRobot's state has it."""
    from robosuite.utils.transform_utils import quat2axisangle

    return np.asarray(quat2axisangle(np.array(quat_xyzw, dtype=np.float64)), dtype=np.float64)


class LiberoEnv:
    """One LIBERO task: soft resets to its official init states, cameras rendered on demand.

    Observations: ``state`` (the 8-d LeRobot state), ``images`` ({our camera name: H x W x 3 uint8}) and
    ``privileged`` (robosuite's observation dict: object poses for the scripted experts, never for policies).
    """

    def __init__(self, task: str, image_size: int = 128, cameras: dict[str, str] | None = None, max_steps: int = 0,
                 state_feature: str = "observation.state", options: LiberoOptions | None = None):
        from libero.libero.envs.env_wrapper import ControlEnv

        if state_feature != "observation.state":
            raise ConfigError(f"state feature {state_feature!r} is not one LIBERO gives; use observation.state")
        self.info = task_info(task)
        self.task, self.instruction = self.info.id, self.info.language
        self.options = options or LiberoOptions()
        self.cameras = dict(CAMERAS if cameras is None else cameras)
        unknown = sorted(set(self.cameras.values()) - {"agentview", "robot0_eye_in_hand", "frontview", "birdview"})
        if unknown:
            raise ConfigError(f"LIBERO has no camera {unknown[0]!r}; cameras: agentview (image), "
                              "robot0_eye_in_hand (image2, wrist), frontview, birdview")
        self.camera_names = list(self.cameras)
        self.max_steps = max_steps or self.info.max_steps
        self.timings = {"sim_s": 0.0, "render_s": 0.0}
        self.init_states = load_init_states(self.info.init_states_file)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            # no robosuite cameras: they would render both views after every step (most of a step's cost)
            self._env = ControlEnv(bddl_file_name=str(self.info.bddl_file), use_camera_obs=False,
                                   has_renderer=False, has_offscreen_renderer=False, hard_reset=False,
                                   camera_heights=image_size, camera_widths=image_size)
        horizon = int(self._env.env.horizon)  # robosuite ends an episode after this many steps per reset
        if self.options.settle_steps + self.max_steps > horizon:
            self._env.close()
            raise ConfigError(f"--env_options.settle_steps={self.options.settle_steps} plus the episode's "
                              f"{self.max_steps} steps exceed robosuite's {horizon} steps per reset (LIBERO's "
                              f"horizon): keep settle_steps at most {max(0, horizon - self.max_steps)}")
        self._model, self._data = self._env.sim.model._model, self._env.sim.data._data
        self._renderer = CameraRenderer(self._model, image_size, self.cameras, _as_lerobot) if self.cameras else None
        self._steps = 0
        self._raw: dict[str, Any] = {}
        self.timings["sim_s"] += time.perf_counter() - start

    # --- the Env protocol ---------------------------------------------------------------------------------------
    def reset(self, seed: int, scene: int = 0) -> dict[str, Any]:
        start = time.perf_counter()
        self._env.seed(int(seed))
        self._env.reset()  # soft: the model stays loaded
        for robot in self._env.robots:  # the one state a soft reset keeps: the gripper's last command
            robot.gripper.current_action = np.zeros(robot.gripper.dof)
        self._raw = self._env.set_init_state(self.init_states[scene % len(self.init_states)])
        for _ in range(self.options.settle_steps):
            self._raw, *_ = self._env.step(NO_OP)
        self._steps = 0
        self.timings["sim_s"] += time.perf_counter() - start
        return self._observation()

    def step(self, action: Any, render: bool = True) -> Step:
        start = time.perf_counter()
        action = np.clip(np.asarray(action, dtype=np.float64), -1.0, 1.0)
        self._raw, reward, _, info = self._env.step(action)
        success = bool(self._env.check_success())
        self._steps += 1
        self.timings["sim_s"] += time.perf_counter() - start
        return Step(self._observation(render), float(reward), success, self._steps >= self.max_steps, info)

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        if getattr(self, "_env", None) is not None:
            self._env.close()
            self._env = None

    def __enter__(self) -> LiberoEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- observations -------------------------------------------------------------------------------------------
    def _observation(self, render: bool = True) -> dict[str, Any]:
        raw = self._raw
        state = np.concatenate([raw["robot0_eef_pos"], axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])
        return {"state": state.astype(np.float32), "images": self.render() if render else {}, "privileged": raw}

    def render(self) -> dict[str, np.ndarray]:
        if self._renderer is None:
            return {}
        start = time.perf_counter()
        images = self._renderer.render(self._data)
        self.timings["render_s"] += time.perf_counter() - start
        return images

    def object_position(self, name: str) -> np.ndarray:
        """A body's world position (the scripted experts' privileged view)."""
        return np.array(self._data.xpos[self._model.body(name).id])


def _as_lerobot(camera: str, image: np.ndarray) -> np.ndarray:
    """LeRobot's 180-degree rotation of robosuite's bottom-row-first frame = our top-row-first frame mirrored."""
    return image[:, ::-1]


def make_env(task: str, request: EnvRequest) -> LiberoEnv:
    return LiberoEnv(task, request.image_size, dict(request.cameras), request.max_steps, request.state_feature,
                     request.options)


ENV_SPEC = EnvSpec("libero", make_env, resolve_tasks, instruction, state_features=("observation.state",),
                   camera_aliases=CAMERA_ALIASES, options=LiberoOptions, default_tasks=("libero_object",),
                   default_cameras=dict(CAMERAS), video_camera="image", catalog=catalog,
                   suite_groups=suite_groups, variants=variants, experts="roboscale.sim.libero_experts:EXPERTS")
