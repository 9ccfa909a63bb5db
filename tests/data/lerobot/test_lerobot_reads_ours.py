"""What our writer writes, LeRobot 0.4.4's own ``LeRobotDataset`` reads as ours does: every item of the small dataset
(5 episodes whose data and video files rotate and whose chunks roll over, a CHW-declared camera, PNG images), the
same keys, tasks and values, action windows with their padding included. Runs LeRobot in its venv
(tests/oracles/README.md); skipped where there is none. (What LeRobot writes, we read: tests/data/lerobot/
test_lerobot_fixture.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from roboscale.data import LeRobotDataset
from tests.oracles.lerobot_oracle import HERE, lerobot_python, run_script

DELTA = {"action": [-0.1, 0.0, 0.1, 0.2]}


def test_lerobot_reads_every_item_of_a_dataset_we_wrote_as_we_do(small_root: Path, tmp_path: Path) -> None:
    python = lerobot_python()
    out = tmp_path / "lerobot.safetensors"
    run_script(python, HERE / "lerobot_dataset.py", str(small_root), str(out), "--delta", json.dumps(DELTA))
    theirs, meta = load_file(str(out)), json.loads(out.with_suffix(".json").read_text())
    ours = LeRobotDataset(root=small_root, delta_timestamps=DELTA)
    assert meta["length"] == len(ours) and meta["num_episodes"] == ours.num_episodes
    for i in range(len(ours)):
        item = ours[i]
        assert item.pop("task") == meta["tasks"][i], i
        keys = {k.partition("/")[2] for k in theirs if k.startswith(f"{i}/")}
        assert set(item) == keys, (i, sorted(set(item) ^ keys))
        for key, value in item.items():
            expected = theirs[f"{i}/{key}"]
            value = torch.as_tensor(value)
            assert value.shape == expected.shape, (i, key, value.shape, expected.shape)
            if value.is_floating_point():  # decoded frames: the same PyAV decode, as float in [0, 1]
                torch.testing.assert_close(value, expected.to(value.dtype), rtol=0, atol=1e-6, msg=f"{i} {key}")
            else:
                assert torch.equal(value, expected.to(value.dtype)), (i, key)
