"""LeRobot's own ``LeRobotDataset`` (lerobot 0.4.4, its PyAV video backend) reading a dataset, as the oracle that
what we write is what LeRobot reads. Runs in LeRobot's venv (tests/oracles/README.md).

    python lerobot_dataset.py ROOT OUT [--delta '{"action": [0, 0.1]}']
        every item of the dataset at ROOT -> OUT (safetensors: ``<index>/<key>``) and OUT.json (each item's task,
        the dataset's length and features as LeRobot's metadata has them)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--delta", default="{}", help="delta_timestamps, as JSON")
    args = parser.parse_args(argv)
    dataset = LeRobotDataset("local/oracle", root=args.root, video_backend="pyav",
                             delta_timestamps=json.loads(args.delta) or None)
    tensors: dict[str, torch.Tensor] = {}
    tasks = []
    for i in range(len(dataset)):
        item = dataset[i]
        tasks.append(item.pop("task"))
        for key, value in item.items():
            tensors[f"{i}/{key}"] = torch.as_tensor(value).contiguous()
    save_file(tensors, str(args.out))
    meta = {"length": len(dataset), "tasks": tasks, "num_episodes": dataset.num_episodes, "fps": dataset.fps,
            "features": sorted(dataset.features)}
    args.out.with_suffix(".json").write_text(json.dumps(meta))


if __name__ == "__main__":
    main(sys.argv[1:])
