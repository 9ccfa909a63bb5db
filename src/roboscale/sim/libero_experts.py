"""Scripted pick-and-place experts for LIBERO's ``libero_object`` and ``libero_spatial`` tasks, with privileged state
(``libero_goal`` and ``libero_10``: ``libero_skills``, sequences of skills per goal predicate).

Both suites' goals are one ``(In obj region)`` or ``(On obj target)`` predicate: pick ``obj`` up, put it in or on
``target``. The expert reads the object poses from the simulator (never shown to policies) and drives the
end-effector with OSC_POSE position deltas through phases: centred above the object, down (slowly, re-centring:
the hand drifts sideways as it descends) until it reaches the object or stops on it, close while pressing on, lift,
carry high (a held bottle clears the basket's rim), lower, open. Bowls, wider than the open gripper, are taken by
the rim. Actions saturate at 1 (robosuite's 5 cm a step); the starting orientation is held, so noise added to the
executed actions (DART) is corrected rather than accumulated. Success per task: docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from roboscale.errors import ConfigError
from roboscale.sim.experts import Expert, ExpertSpec
from roboscale.sim.libero import ACTION_DIM, FPS, STATE_DIM, LiberoEnv
from roboscale.sim.libero_control import ALIGNED, BOWL_RIM, CLOSE_STEPS, GAIN, OPEN_STEPS, ROTATION_GAIN, STALL_STEPS

CLEARANCE = 0.12  # approach height above the object
CARRY = 0.30  # travel height above the target: a held object clears the basket's rim
PLACE_IN = 0.15  # release height above a container (the basket) ...
PLACE_ON = 0.10  # ... and above a surface (the plate)


def observation_features(image_size: int, cameras: dict[str, str]) -> dict[str, dict]:
    features: dict[str, dict] = {
        f"observation.images.{name}": {"dtype": "video", "shape": [image_size, image_size, 3],
                                       "names": ["height", "width", "channels"]}
        for name in cameras
    }
    features["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM],
                                     "names": ["x", "y", "z", "ax", "ay", "az", "gripper_l", "gripper_r"]}
    return features


class PickPlace:
    """The phases of one pick-and-place; ``__call__`` is the next action for an observation."""

    def __init__(self, env: LiberoEnv):
        goal = env._env.env.parsed_problem["goal_state"]
        if len(goal) != 1 or goal[0][0].lower() not in ("in", "on"):
            raise ConfigError(f"LIBERO task {env.task}: no scripted expert for the goal {goal} (experts handle one "
                              "In/On predicate: libero_object and libero_spatial)")
        relation, self.obj, target = goal[0]
        # a bowl is wider than the open gripper: grasp its rim, where the wall runs across the fingers
        self.offset = np.array([0.0, -BOWL_RIM, 0.0]) if "bowl" in self.obj else np.zeros(3)
        self.place = PLACE_IN if relation.lower() == "in" else PLACE_ON
        self.env = env
        self.target_body = self._body_of(target)
        self.phase, self.count = "above_object", 0
        self.orientation: np.ndarray | None = None  # the hand's orientation at the start, held throughout
        self.target: np.ndarray | None = None
        self.last_z, self.pushed_down = np.inf, False

    def _body_of(self, name: str) -> str:
        """A goal names a region (``basket_1_contain_region``) or an object (``plate_1``): its body."""
        bodies = {self.env._model.body(i).name for i in range(self.env._model.nbody)}
        for candidate in (f"{name}_main", name, f"{name.removesuffix('_contain_region')}_main"):
            if candidate in bodies:
                return candidate
        raise ConfigError(f"LIBERO task {self.env.task}: no body for the goal's {name!r}")

    def __call__(self, observation: dict[str, Any]) -> np.ndarray:
        raw = observation["privileged"]
        eef = raw["robot0_eef_pos"]
        obj = raw[f"{self.obj}_pos"] + self.offset
        if self.target is None or self.phase in ("above_object", "down", "close"):
            self.target = self.env.object_position(self.target_body)  # fixed once the object is held
        target = self.target + self.offset
        grip = -1.0
        if self.phase == "above_object":
            goal = obj + [0, 0, CLEARANCE]
            if np.linalg.norm((goal - eef)[:2]) < ALIGNED and abs(goal[2] - eef[2]) < 0.02:
                self.phase = "down"
        if self.phase == "down":
            goal = grasp = obj + [0, 0, 0.01]
            descending = np.linalg.norm((goal - eef)[:2]) <= 2 * ALIGNED
            if not descending:  # the hand drifted: centre it before going lower
                goal = np.array([grasp[0], grasp[1], eef[2]])
            # the fingers rest on the object's top or the table: grasp where the hand stopped going down
            low = eef[2] < obj[2] + CLEARANCE - 0.03  # contact happens below the approach height, not at its start
            stalled = descending and self.pushed_down and low and self.last_z - eef[2] < 0.001
            self.count = self.count + 1 if stalled else 0
            self.last_z, self.pushed_down = eef[2], descending
            if np.linalg.norm(grasp - eef) < 0.01 or self.count >= STALL_STEPS:
                self.phase, self.count = "close", 0
        if self.phase == "close":
            goal, grip = obj + [0, 0, 0.01], 1.0  # pressing on while the fingers close: flat objects too
            self.count += 1
            if self.count >= CLOSE_STEPS:
                self.phase = "lift"
        if self.phase == "lift":
            goal, grip = np.array([eef[0], eef[1], target[2] + CARRY]), 1.0
            if eef[2] > goal[2] - 0.02:
                self.phase = "above_target"
        if self.phase == "above_target":
            goal, grip = np.array([target[0], target[1], target[2] + CARRY]), 1.0
            if np.linalg.norm((goal - eef)[:2]) < 0.015:
                self.phase = "lower"
        if self.phase == "lower":
            goal, grip = np.array([target[0], target[1], target[2] + self.place]), 1.0
            if eef[2] < goal[2] + 0.015:
                self.phase, self.count = "release", 0
        if self.phase == "release":
            goal, grip = eef.copy(), -1.0
            self.count += 1
            if self.count >= OPEN_STEPS:
                self.phase = "retreat"
        if self.phase == "retreat":
            goal, grip = np.array([eef[0], eef[1], target[2] + CARRY]), -1.0
        action = np.zeros(ACTION_DIM, dtype=np.float32)
        action[:3] = np.clip(GAIN * (goal - eef), -1.0, 1.0)
        action[3:6] = self._hold_orientation(raw["robot0_eef_quat"])
        if self.phase == "down":  # a slower descent, held over the object: the hand drifts sideways as it goes down
            action[:2] = np.clip(2 * GAIN * (goal - eef)[:2], -1.0, 1.0)
            action[2] = max(action[2], -0.5)
        action[6] = grip
        return action


    def _hold_orientation(self, quat_xyzw: np.ndarray) -> np.ndarray:
        """Rotation deltas back to the starting orientation (noise in the executed actions turns the hand)."""
        from robosuite.utils.transform_utils import mat2quat, quat2axisangle, quat2mat

        current = quat2mat(quat_xyzw)
        if self.orientation is None:
            self.orientation = current
        error = quat2axisangle(mat2quat(self.orientation @ current.T))  # world frame, as OSC_POSE takes it
        return np.clip(ROTATION_GAIN * error, -1.0, 1.0)


SKILL_SUITES = ("libero_goal", "libero_10")
"""Suites whose experts are sequences of skills (libero_skills); the others keep PickPlace (its documented numbers)."""


def expert(env: LiberoEnv) -> Expert:
    if env.info.base_suite in SKILL_SUITES:
        from roboscale.sim.libero_skills import Sequence  # loaded only for the suites that need it

        return Sequence(env)
    return PickPlace(env)


def frame(observation: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"observation.state": observation["state"]}


EXPERTS = ExpertSpec(fps=FPS, robot_type="panda", observation_features=observation_features,
                     action_names=("dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"), expert=expert,
                     frame=frame, max_steps=0)  # 0: the suite's own limit (libero_10's two steps need 520)
