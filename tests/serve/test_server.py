"""`roboscale serve`: openpi's protocol, batching across connections without changing any chunk, keys, faults
from clients (malformed, oversized, stalled, vanished), the API key, the health check and a clean shutdown."""

from __future__ import annotations

import base64
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from roboscale.configs.rollout import RunnerConfig
from roboscale.configs.serve import ServeConfig
from roboscale.errors import ConfigError
from roboscale.rollout.inference import PredictItem, RunnerSettings
from roboscale.serve.command import build_server
from roboscale.transport.wire import pack, unpack
from roboscale.utils.images import resize_with_pad
from tests.serve.conftest import observation, served

TIMEOUT_S = 60


def ask(ws, obs) -> dict | str:
    ws.send(pack(obs))
    reply = ws.recv(timeout=TIMEOUT_S)
    return reply if isinstance(reply, str) else unpack(reply)


def client(url, **options):
    ws = connect(url, compression=None, max_size=None, open_timeout=TIMEOUT_S, legacy=True, **options)
    metadata = unpack(ws.recv(timeout=TIMEOUT_S))
    return ws, metadata


def test_a_connection_gets_metadata_then_a_chunk_per_observation_in_the_datasets_units(checkpoint):
    with served(checkpoint=checkpoint) as (_, url):
        ws, metadata = client(url)
        with ws:
            assert metadata["policy"] == "pi05" and metadata["n_action_steps"] == 3
            assert metadata["keys"]["images"] == {"corner2": "observation.images.corner2",
                                                  "wrist": "observation.images.wrist"}
            assert len(metadata["checkpoint_sha256"]) == 64 and metadata["policy_config"]["chunk_size"] == 6
            reply = ask(ws, observation(seed=3))
            assert reply["actions"].shape == (6, 4) and reply["actions"].dtype == np.float32
            assert reply["seed"] == 3 and reply["server_timing"]["batch_size"] == 1
            assert reply["server_timing"]["total_ms"] >= reply["server_timing"]["infer_ms"] > 0
            # the chunk is what the rollout engine's own runner predicts for that seed and chunk index
            runner = RunnerSettings(str(Path(checkpoint)), "cpu").build()
            obs = observation(seed=3)
            item = PredictItem(0, 3, 0, "Open a drawer", obs["observation.state"],
                               {"corner2": obs["observation.images.corner2"], "wrist": obs["observation.images.wrist"]})
            np.testing.assert_allclose(reply["actions"], runner.predict([item])[0].chunk, rtol=0, atol=1e-6)
            unseeded = [ask(ws, observation(seed=None))["seed"] for _ in range(2)]
            assert unseeded[0] != unseeded[1]  # no seed: fresh noise each time, and the seed said for a replay


def test_batches_across_connections_change_no_chunk(checkpoint):
    """Four robots at once: their observations are predicted together, and each gets the chunk it gets alone."""
    with served(checkpoint=checkpoint, runner=RunnerConfig(batch_timeout_ms=200)) as (server, url):
        ws, _ = client(url)
        with ws:
            alone = {seed: ask(ws, observation(seed=seed))["actions"] for seed in range(4)}
            again = ask(ws, observation(seed=0))["actions"]
        assert np.array_equal(alone[0], again)
        connections = [client(url)[0] for _ in range(4)]
        together: dict[int, np.ndarray] = {}
        barrier = threading.Barrier(4)

        def robot(seed: int) -> None:
            barrier.wait()
            together[seed] = ask(connections[seed], observation(seed=seed))["actions"]

        threads = [threading.Thread(target=robot, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        for ws in connections:
            ws.close()
        assert max(server.batcher.stats().sizes) > 1  # predicted together
        for seed in range(4):  # float32 rounding of batched products aside (tests/eval/test_eval.py)
            np.testing.assert_allclose(together[seed], alone[seed], rtol=0, atol=1e-5)
        assert not np.allclose(alone[0], alone[1])  # the seeds make a difference


def test_images_of_any_size_are_fitted_as_in_training(checkpoint):
    with served(checkpoint=checkpoint) as (_, url):
        ws, _ = client(url)
        with ws:
            large = observation(seed=5, size=(120, 75))
            fitted = dict(large)
            for key in ("observation.images.corner2", "observation.images.wrist"):
                chw = torch.from_numpy(large[key].transpose(2, 0, 1).copy())
                fitted[key] = resize_with_pad(chw, 32).numpy().transpose(1, 2, 0)
            channels_first = {**large, "observation.images.wrist": large["observation.images.wrist"].transpose(2, 0, 1)}
            chunk = ask(ws, large)["actions"]
            assert np.array_equal(chunk, ask(ws, fitted)["actions"])
            assert np.array_equal(chunk, ask(ws, channels_first)["actions"])


BAD_REQUESTS = {
    "not msgpack": (b"\xc1\xc1 not msgpack", "not a msgpack message"),
    "text frame": ("hello", "binary msgpack"),
    "missing camera": ({**observation(), "observation.images.wrist": None}, "'observation.images.wrist'"),
    "wrong image shape": ({**observation(), "observation.images.corner2": np.zeros((32, 32), np.uint8)},
                          "'observation.images.corner2' must be an image array of H x W x 3"),
    "wrong state size": ({**observation(), "observation.state": np.zeros(7, np.float32)},
                         "'observation.state' has 7 values; this policy reads a state of 4"),
    "NaN state": ({**observation(), "observation.state": np.array([0, np.nan, 0, 0], np.float32)}, "NaN"),
    "string state": ({**observation(), "observation.state": "0 0 0 0"}, "'observation.state' must be a numeric"),
    "huge declared array": (None, "needs 4000000000000 bytes"),
    "missing prompt": ({k: v for k, v in observation().items() if k != "prompt"}, "missing key 'prompt'"),
    "bad seed": ({**observation(), "seed": -1}, "'seed' must be an integer"),
    "committed without --rtc": ({**observation(), "committed": np.zeros((3, 4), np.float32)}, "--rtc"),
}


def _message(case: str):
    message, _ = BAD_REQUESTS[case]
    if case == "huge declared array":
        import msgpack
        obs = {k: v for k, v in observation().items()}
        packed = msgpack.unpackb(pack(obs), raw=False)
        packed["observation.state"] = {b"__ndarray__": True, b"data": b"1234", b"dtype": "<f4",
                                       b"shape": [1000000, 1000000]}
        return msgpack.packb(packed)
    if case == "missing camera":
        message = {k: v for k, v in message.items() if v is not None}
    return message if isinstance(message, str | bytes) else pack(message)


def test_malformed_requests_get_an_error_frame_and_the_connection_keeps_serving(checkpoint):
    with served(checkpoint=checkpoint) as (server, url):
        ws, _ = client(url)
        other, _ = client(url)
        with ws, other:
            calls = server.batcher.stats().calls
            for case, (_, expected) in BAD_REQUESTS.items():
                ws.send(_message(case))
                reply = ws.recv(timeout=TIMEOUT_S)
                assert isinstance(reply, str) and expected in reply, (case, reply)
            assert server.batcher.stats().calls == calls  # refused before any model work
            assert ask(ws, observation())["actions"].shape == (6, 4)  # the same connection goes on
            assert ask(other, observation())["actions"].shape == (6, 4)


def test_a_message_over_the_size_limit_closes_only_its_own_connection(checkpoint):
    with served(checkpoint=checkpoint, max_message_mb=0.05) as (_, url):
        big, _ = client(url)
        small, _ = client(url)
        with big, small:
            big.send(pack(observation(size=(200, 200))))  # 2 x 120 KB of pixels
            with pytest.raises(ConnectionClosed) as closed:
                big.recv(timeout=TIMEOUT_S)
            assert closed.value.rcvd.code == 1009  # message too big
            assert ask(small, observation())["actions"].shape == (6, 4)


def _raw_handshake(url: str) -> socket.socket:
    host, port = url.removeprefix("ws://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    response = b""
    while b"\r\n\r\n" not in response:
        response += sock.recv(4096)
    assert response.startswith(b"HTTP/1.1 101")
    return sock


def _masked_frame_header(length: int) -> bytes:
    """A binary frame's header (FIN, masked, 64-bit length) and its mask key (zero: the payload as it is)."""
    return bytes([0x82, 0x80 | 127]) + struct.pack(">Q", length) + bytes(4)


def test_a_client_that_stalls_mid_message_or_vanishes_mid_request_blocks_nobody(checkpoint):
    with served(checkpoint=checkpoint, runner=RunnerConfig(batch_timeout_ms=50)) as (_, url):
        stalled = _raw_handshake(url)
        stalled.sendall(_masked_frame_header(10_000) + b"\x82" * 100)  # 100 of 10,000 bytes, then nothing
        vanishing = _raw_handshake(url)
        payload = pack(observation())
        vanishing.sendall(_masked_frame_header(len(payload)) + payload)
        vanishing.close()  # gone before its answer
        ws, _ = client(url)
        with ws:
            for seed in range(3):
                assert ask(ws, observation(seed=seed))["actions"].shape == (6, 4)
            stalled.close()
            assert ask(ws, observation())["actions"].shape == (6, 4)


def test_in_flight_requests_are_answered_before_a_shutdown_closes_the_connections(checkpoint):
    with served(checkpoint=checkpoint) as (server, url):
        entered, release = threading.Event(), threading.Event()
        predict = server.predictor.predict

        def held_predict(items):
            entered.set()
            assert release.wait(TIMEOUT_S)
            return predict(items)

        server.predictor.predict = held_predict
        ws, _ = client(url)
        ws.send(pack(observation()))
        assert entered.wait(TIMEOUT_S)
        server.stop()  # while the request is being predicted
        release.set()
        reply = ws.recv(timeout=TIMEOUT_S)
        assert unpack(reply)["actions"].shape == (6, 4)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=TIMEOUT_S)
        assert closed.value.rcvd.code == 1001  # going away


def test_the_api_key_is_checked_before_the_handshake(checkpoint, tmp_path):
    (tmp_path / "key.txt").write_text("s3cret-key\n")
    with served(checkpoint=checkpoint, api_key_file=str(tmp_path / "key.txt")) as (server, url):
        for headers in (None, {"Authorization": "Api-Key wrong"}, {"Authorization": "Bearer s3cret-key"}):
            with pytest.raises(InvalidStatus) as refused:
                connect(url, additional_headers=headers, open_timeout=TIMEOUT_S, legacy=True)
            assert refused.value.response.status_code == 401
        assert server.batcher.stats().calls == 0
        ws, _ = client(url, additional_headers={"Authorization": "Api-Key s3cret-key"})
        with ws:
            assert ask(ws, observation())["actions"].shape == (6, 4)


def test_only_loopback_without_a_key(checkpoint, tmp_path):
    assert ServeConfig().host == "127.0.0.1"
    for host in ("0.0.0.0", "192.168.1.5", "robot-gpu.local"):  # refused before the checkpoint is even read
        with pytest.raises(ConfigError, match=f"--host={host} listens beyond this machine: give --api_key_file"):
            build_server(ServeConfig(checkpoint=str(tmp_path / "missing"), host=host))
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ConfigError, match="--api_key_file: .*empty"):
        build_server(ServeConfig(checkpoint=checkpoint, host="0.0.0.0", api_key_file=str(tmp_path / "empty.txt")))
    with served(checkpoint=checkpoint) as (server, _):
        assert server.address[0] == "127.0.0.1"


def test_openpis_example_client_keys_and_a_free_mapping(checkpoint):
    with served(checkpoint=checkpoint, keys="openpi_libero") as (_, url):
        ws, metadata = client(url)
        with ws:
            assert metadata["keys"]["images"] == {"corner2": "observation/image", "wrist": "observation/wrist_image"}
            obs = observation(seed=2)
            libero = {"observation/image": obs["observation.images.corner2"],
                      "observation/wrist_image": obs["observation.images.wrist"],
                      "observation/state": obs["observation.state"], "prompt": obs["prompt"], "seed": 2}
            chunk = ask(ws, libero)["actions"]
            missing = ask(ws, {k: v for k, v in libero.items() if k != "observation/wrist_image"})
            assert missing == "error: missing key 'observation/wrist_image' (a camera image: H x W x 3 uint8)"
    with served(checkpoint=checkpoint, key_map={"observation.state": "arm+gripper",
                                                "observation.images.wrist": "hand_cam"}) as (_, url):
        ws, _ = client(url)
        with ws:
            mapped = {**{k: v for k, v in obs.items() if k not in ("observation.state", "observation.images.wrist")},
                      "arm": obs["observation.state"][:3], "gripper": obs["observation.state"][3:],
                      "hand_cam": obs["observation.images.wrist"]}
            assert np.array_equal(ask(ws, mapped)["actions"], chunk)
            assert "'arm+gripper' has 5 values" in ask(ws, {**mapped, "gripper": np.zeros(2, np.float32)})
    with pytest.raises(ConfigError, match="--key_map: 'observation.images.top' is not an input of this policy"):
        build_server(ServeConfig(checkpoint=checkpoint, key_map={"observation.images.top": "x"}))


def test_the_health_check_and_a_sigterm_of_the_command(checkpoint, tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "roboscale", "serve", f"--checkpoint={checkpoint}", "--port=0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = process.stdout.readline()
        assert line.startswith("serving on ws://127.0.0.1:"), line + process.stderr.read()
        url = line.split()[2]
        health = url.replace("ws://", "http://") + "/healthz"
        with urllib.request.urlopen(health, timeout=TIMEOUT_S) as response:
            assert response.status == 200 and response.read() == b"OK\n"
        ws, _ = client(url)
        assert ask(ws, observation())["actions"].shape == (6, 4)
        process.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=TIMEOUT_S)
        assert closed.value.rcvd.code == 1001
        assert process.wait(TIMEOUT_S) == 0
        assert "closed (1001): 1 requests, 0 errors" in process.stderr.read()
    finally:
        process.kill()
        process.wait()


def test_real_time_chunking_guides_the_next_chunk_to_the_committed_actions(checkpoint):
    """--rtc: a request with the previous chunk's unexecuted actions gets a chunk that continues them."""
    with served(checkpoint=checkpoint, rtc=True) as (_, url):
        ws, metadata = client(url)
        with ws:
            assert metadata["rtc"] and "committed" in metadata["keys"]["optional"]
            previous = ask(ws, observation(seed=1))["actions"]
            committed = previous[3:]  # 3 of the 6 executed when the next observation was taken
            naive = ask(ws, observation(seed=2))["actions"]
            guided = ask(ws, observation(seed=2, committed=committed, delay=2))["actions"]
            frozen_naive = np.abs(naive[:2] - committed[:2]).mean()
            frozen_guided = np.abs(guided[:2] - committed[:2]).mean()
            assert frozen_guided < 0.2 * frozen_naive
            assert np.array_equal(ask(ws, observation(seed=2))["actions"], naive)  # unguided requests unchanged
            for bad, expected in (({"committed": committed, "delay": 4}, "'delay' must be an integer in [0, 4)"),
                                  ({"committed": committed[:, :2]}, "'committed' has shape [3, 2]"),
                                  ({"delay": 1}, "'delay' was sent without 'committed'")):
                reply = ask(ws, observation(seed=2, **bad))
                assert isinstance(reply, str) and expected in reply, reply


def test_a_groot_checkpoint_is_served_the_same_way(tmp_path):
    from tests.models.test_groot import tiny_groot

    path = tmp_path / "groot" / "pretrained_model"
    tiny_groot().save_pretrained(path)
    with served(checkpoint=str(path), rtc=True) as (_, url):
        ws, metadata = client(url)
        with ws:
            assert metadata["policy"] == "groot"
            first = ask(ws, observation(seed=4, size=(48, 40)))["actions"]
            assert first.shape == (metadata["policy_config"]["chunk_size"], 4)
            assert np.array_equal(ask(ws, observation(seed=4, size=(48, 40)))["actions"], first)
            guided = ask(ws, observation(seed=5, committed=first[2:], delay=1))["actions"]
            naive = ask(ws, observation(seed=5))["actions"]
            assert np.abs(guided[0] - first[2]).mean() < 0.2 * np.abs(naive[0] - first[2]).mean()
