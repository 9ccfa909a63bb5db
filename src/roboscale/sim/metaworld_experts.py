"""MetaWorld's scripted experts (its hand-written policies, which read the 39-d observation) as an ``ExpertSpec``."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from roboscale.sim.experts import Expert, ExpertSpec
from roboscale.sim.metaworld import ACTION_DIM, FPS, FULL_STATE_DIM, STATE_DIM, MetaWorldEnv

# MetaWorld's scripted experts are proportional controllers with gains above 1 and warn, on every step that
# saturates, that the environment clips their action to [-1, 1]. The clipping is what they are written for, and a
# demo printed that warning dozens of times: silence exactly that message (in this process and in the expert
# workers, which import this module).
warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)


def observation_features(image_size: int, cameras: dict[str, str]) -> dict[str, dict]:
    features: dict[str, dict] = {
        f"observation.images.{name}": {
            "dtype": "video",
            "shape": [image_size, image_size, 3],
            "names": ["height", "width", "channels"],
        }
        for name in cameras
    }
    features["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM], "names": ["x", "y", "z", "gripper"]}
    features["observation.environment_state"] = {"dtype": "float32", "shape": [FULL_STATE_DIM], "names": None}
    return features


def expert(env: MetaWorldEnv) -> Expert:
    from metaworld.policies import ENV_POLICY_MAP

    policy = ENV_POLICY_MAP[env.task]()
    return lambda observation: policy.get_action(observation["full_state"])


def frame(observation: dict[str, Any]) -> dict[str, np.ndarray]:
    full = observation["full_state"].astype(np.float32)
    return {"observation.state": full[:STATE_DIM], "observation.environment_state": full}


EXPERTS = ExpertSpec(fps=FPS, robot_type="sawyer", observation_features=observation_features,
                     action_names=("dx", "dy", "dz", "grip")[:ACTION_DIM], expert=expert, frame=frame, max_steps=300)
