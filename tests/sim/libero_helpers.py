"""A tiny pi0.5 with LIBERO's features (two 32² cameras, 8-d state, 7-d actions), saved as a training run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np


def tiny_libero_run(run_dir: Path, tasks: list[str]) -> Path:
    """A training run directory whose pretrained_model is an untrained tiny pi0.5 for LIBERO; returns it."""
    import torch

    from roboscale.models.registry import build_policy
    from tests.models.helpers import tiny_config

    cameras = ["observation.images.image", "observation.images.image2"]
    ones = {"q01": -1, "q99": 1, "mean": 0, "std": 1, "min": -1, "max": 1}
    stats = {key: {k: np.full(dim, v, dtype=np.float32) for k, v in ones.items()}
             for key, dim in (("observation.state", 8), ("action", 7))}
    features = {"observation.state": {"shape": [8]}, "action": {"shape": [7]},
                **{k: {"dtype": "video", "shape": [32, 32, 3]} for k in cameras}}
    meta = SimpleNamespace(root="<memory>", features=features, camera_keys=cameras, fps=20, task_list=tasks,
                           stats=stats)
    torch.manual_seed(0)
    build_policy(tiny_config(), meta).save_pretrained(run_dir / "pretrained_model")
    return run_dir
