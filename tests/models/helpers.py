"""A tiny policy and batches for model tests (no dataset on disk needed)."""

from types import SimpleNamespace

import numpy as np
import torch

from roboscale.models.pi05.config import Pi05Config
from roboscale.models.registry import build_policy

TASKS = ["Rotate the faucet clockwise", "Rotate the faucet counter-clockwise", "Open a drawer"]
CAMERAS = ["observation.images.corner2", "observation.images.wrist"]


def fake_meta(state_dim=4, action_dim=4):
    stats = {
        "observation.state": {"q01": -np.ones(state_dim), "q99": np.ones(state_dim), "mean": np.zeros(state_dim),
                              "std": np.ones(state_dim), "min": -np.ones(state_dim), "max": np.ones(state_dim)},
        "action": {"q01": -np.ones(action_dim), "q99": np.ones(action_dim), "mean": np.zeros(action_dim),
                   "std": np.ones(action_dim), "min": -np.ones(action_dim), "max": np.ones(action_dim)},
    }
    features = {"observation.state": {"shape": [state_dim]}, "action": {"shape": [action_dim]}}
    features.update({k: {"dtype": "video", "shape": [32, 32, 3]} for k in CAMERAS})
    return SimpleNamespace(root="<memory>", features=features, camera_keys=list(CAMERAS), fps=80, task_list=TASKS,
                           stats=stats)


def tiny_config(**overrides) -> Pi05Config:
    base = dict(image_size=32, vit_patch_size=8, vit_dim=32, vit_depth=1, vit_heads=2, pixel_shuffle=2, width=48,
                depth=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, expert_width=32, expert_mlp_dim=48,
                chunk_size=6, n_action_steps=3, num_inference_steps=3, random_shift=0)
    base.update(overrides)
    return Pi05Config(**base)


def tiny_policy(**overrides):
    torch.manual_seed(0)
    return build_policy(tiny_config(**overrides), fake_meta())


def batch(b=4, chunk=6, seed=0, tasks=None):
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randint(0, 256, (b, 3, 32, 32), generator=g, dtype=torch.uint8) for k in CAMERAS}
    out["observation.state"] = torch.randn(b, 4, generator=g)
    out["action"] = torch.rand(b, chunk, 4, generator=g) * 2 - 1
    out["action_is_pad"] = torch.zeros(b, chunk, dtype=torch.bool)
    out["task"] = tasks or [TASKS[i % len(TASKS)] for i in range(b)]
    return out


def sample_dicts(n=5, chunk=6, seed=0, drop=((1, 1), (3, 0))):
    """Per-sample LeRobot-style dicts (what a loader worker hands the transform) with varied prompts, some padded
    action steps, and cameras missing from some samples: ``drop`` lists (sample, camera index) pairs."""
    g = torch.Generator().manual_seed(seed)
    tasks = TASKS + ["Press the button from the top while avoiding the wall", "Go"]
    out = []
    for i in range(n):
        s = {k: torch.randint(0, 256, (3, 32, 32), generator=g, dtype=torch.uint8) for k in CAMERAS}
        for j, c in drop:
            if j == i:
                del s[CAMERAS[c]]
        s["observation.state"] = torch.randn(4, generator=g)
        s["action"] = torch.rand(chunk, 4, generator=g) * 2 - 1
        s["action_is_pad"] = torch.arange(chunk) >= chunk - (i % 3)
        s["task"] = tasks[i % len(tasks)]
        s["episode_index"], s["frame_index"] = i, 10 * i
        out.append(s)
    return out
