"""A toy environment adapter for engine tests: fast, deterministic, no simulator, and with tasks that misbehave on
purpose (crash the process, hang, raise) the first time each episode runs.

The state is a point in [-1, 1]^4 that an action moves by 0.1 x action; success is reaching the goal (drawn from
the seed) within 0.15. Cameras render the state and goal as flat colors, so the policy's input changes each step.
Misbehaving tasks leave a marker in ``ROBOSCALE_FAKE_ENV_MARKERS`` when they first misbehave, so a retry of the
same episode runs normally.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from roboscale.errors import ConfigError
from roboscale.sim.env import EnvRequest, EnvSpec, Step
from roboscale.sim.experts import Expert, ExpertSpec

TASKS = {"reach": "Reach the goal", "reach-far": "Reach the far goal", "crash-once": "Reach, crashing once",
         "hang-once": "Reach, hanging once", "raise-always": "Reach, raising always", "broken-camera": "No camera",
         "out-of-reach": "Reach a goal beyond the walls"}


class PointEnv:
    def __init__(self, task: str, image_size: int = 32, cameras: dict | None = None, max_steps: int = 30,
                 state_feature: str = "observation.state", options: None = None):
        self.task = task
        self.instruction = TASKS[task]
        self.camera_names = list(cameras or {})
        self.image_size = image_size
        self.max_steps = max_steps
        self.timings = {"sim_s": 0.0, "render_s": 0.0}
        if task == "broken-camera" and self.camera_names:
            raise ValueError(f"no camera named {self.camera_names[0]!r}")

    def _observation(self) -> dict:
        value = ((np.concatenate([self.state, self.goal]) + 1) * 127).clip(0, 255).astype(np.uint8)
        images = {name: np.broadcast_to(value[i % 8: i % 8 + 3], (self.image_size, self.image_size, 3)).copy()
                  for i, name in enumerate(self.camera_names)}
        return {"state": self.state.astype(np.float32), "images": images}

    def reset(self, seed: int, scene: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        self.seed = seed
        self.state = rng.uniform(-0.5, 0.5, 4)
        self.goal = rng.uniform(-1, 1, 4) * (1.0 if self.task == "reach-far" else 0.3)
        if self.task == "out-of-reach":
            self.goal[0] = 1.5  # the state stays in [-1, 1]: no expert succeeds
        if self.task == "reach" and seed % 3 == 0:
            self.goal = self.state + rng.uniform(-0.05, 0.05, 4)  # a goal at hand: success in the first steps
        self.limit = self.max_steps - seed % 5  # episodes of different lengths
        self.steps = 0
        return self._observation()

    def step(self, action, render: bool = True) -> Step:
        self.steps += 1
        if self.steps == 3:
            self._misbehave()
        self.state = np.clip(self.state + 0.1 * np.asarray(action, dtype=np.float64), -1, 1)
        distance = float(np.linalg.norm(self.state - self.goal))
        observation = self._observation() if render else {"state": self.state.astype(np.float32), "images": {}}
        return Step(observation, -distance, distance < 0.15, self.steps >= self.limit, {})

    def _misbehave(self) -> None:
        if self.task == "raise-always":
            raise RuntimeError("the simulator diverged")
        if self.task not in ("crash-once", "hang-once"):
            return
        marker = Path(os.environ["ROBOSCALE_FAKE_ENV_MARKERS"]) / f"{self.task}-{self.seed}"
        if marker.exists():
            return
        marker.touch()
        if self.task == "crash-once":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # a simulator stuck in native code: only the engine's watchdog ends it

    def close(self) -> None:
        pass


def resolve(names) -> list[str]:
    for name in names:
        if name not in TASKS:
            raise ConfigError(f"unknown fake task {name!r}")
    return list(dict.fromkeys(names))


def make_point_env(task: str, request: EnvRequest) -> PointEnv:
    return PointEnv(task, request.image_size, request.cameras, request.max_steps or 30, request.state_feature)


def observation_features(image_size: int, cameras: dict[str, str]) -> dict[str, dict]:
    features = {f"observation.images.{name}": {"dtype": "video", "shape": [image_size, image_size, 3],
                                               "names": ["height", "width", "channels"]} for name in cameras}
    features["observation.state"] = {"dtype": "float32", "shape": [4], "names": None}
    return features


def expert(env: PointEnv) -> Expert:
    """Straight at the goal (privileged: the env's own), as fast as actions go."""
    return lambda observation: np.clip((env.goal - observation["state"]) / 0.1, -1.0, 1.0)


EXPERTS = ExpertSpec(fps=10, robot_type="point", observation_features=observation_features,
                     action_names=("a0", "a1", "a2", "a3"), expert=expert,
                     frame=lambda observation: {"observation.state": observation["state"]}, max_steps=30)

SPEC = EnvSpec("fake-point", make_point_env, resolve, TASKS.__getitem__,
               camera_aliases={"corner2": "corner2", "wrist": "wrist"}, experts="tests.rollout.fake_envs:EXPERTS")
