"""The real ``openpi-client`` (its own venv: it pins numpy < 2) drives `roboscale serve` unchanged: metadata, a
chunk per inference, ``ActionChunkBroker`` slicing it, an error raised and the connection still usable, the API
key header. `make install` builds the venv (.venv-openpi)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from roboscale.transport.wire import pack, unpack
from tests.serve.conftest import served

OPENPI_PYTHON = Path(os.environ.get("ROBOSCALE_OPENPI_PYTHON",
                                    Path(__file__).parents[2] / ".venv-openpi" / "bin" / "python"))

CLIENT = r"""
import json, sys
import numpy as np
from openpi_client import action_chunk_broker, websocket_client_policy

url, key = sys.argv[1], sys.argv[2]
policy = websocket_client_policy.WebsocketClientPolicy(url, api_key=key)
metadata = policy.get_server_metadata()
rng = np.random.default_rng(0)
obs = {"observation/image": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
       "observation/wrist_image": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
       "observation/state": rng.uniform(-1, 1, 4).astype(np.float32), "prompt": "Open a drawer", "seed": 3}
np.save(sys.argv[3], np.stack([obs["observation/image"], obs["observation/wrist_image"]]))
np.save(sys.argv[4], obs["observation/state"])
out = {"policy": metadata["policy"], "keys": metadata["keys"]["images"]}
reply = policy.infer(obs)
out["actions"] = reply["actions"].tolist()
out["timing"] = sorted(reply["server_timing"])
try:
    policy.infer({**obs, "observation/state": np.zeros(9, np.float32)})
except RuntimeError as exc:
    out["error"] = str(exc)
out["after_error"] = list(policy.infer(obs)["actions"].shape)
broker = action_chunk_broker.ActionChunkBroker(policy, action_horizon=3)
out["brokered"] = [broker.infer(obs)["actions"].tolist() for _ in range(6)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def openpi_python() -> Path:
    if not OPENPI_PYTHON.is_file():
        pytest.skip(f"openpi-client's venv is not at {OPENPI_PYTHON} (make install builds it)")
    return OPENPI_PYTHON


def test_openpis_websocket_client_and_chunk_broker_drive_the_server(openpi_python, checkpoint, tmp_path):
    (tmp_path / "key").write_text("k3y\n")
    with served(checkpoint=checkpoint, keys="openpi_libero", api_key_file=str(tmp_path / "key")) as (server, url):
        images, state = tmp_path / "images.npy", tmp_path / "state.npy"
        run = subprocess.run([str(openpi_python), "-c", CLIENT, url, "k3y", str(images), str(state)],
                             capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.splitlines()[-1])
        requests = server.batcher.stats().items
        # the same observation from our own client: the same chunk
        from websockets.sync.client import connect

        with connect(url, additional_headers={"Authorization": "Api-Key k3y"}, compression=None) as ws:
            ws.recv()
            both = np.load(images)
            ws.send(pack({"observation/image": both[0], "observation/wrist_image": both[1],
                          "observation/state": np.load(state), "prompt": "Open a drawer", "seed": 3}))
            ours = unpack(ws.recv())["actions"]
    assert out["policy"] == "pi05"
    assert out["keys"] == {"corner2": "observation/image", "wrist": "observation/wrist_image"}
    np.testing.assert_array_equal(np.asarray(out["actions"], dtype=np.float32), ours)
    assert out["timing"] == ["batch_size", "infer_ms", "total_ms"]
    assert out["error"].startswith("Error in inference server:\nerror: 'observation/state' has 9 values")
    assert out["after_error"] == [6, 4]
    # the broker asks once per 3 steps and hands out the chunk's rows in order
    assert np.allclose(out["brokered"][:3], out["actions"][:3]) and np.allclose(out["brokered"][3:], out["actions"][:3])
    assert requests == 1 + 1 + 2  # infer, infer after the error, the broker's two (the refused one never ran)
