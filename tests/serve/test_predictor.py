"""The seam between serving and predicting: the websocket server serves any ``Predictor`` with a layout and
metadata (here a few-line fake, no checkpoint), the rollout's own client reads it back, and both of the rollout's
predictors conform to the protocol."""

from __future__ import annotations

import numpy as np
import pytest

from roboscale.errors import ConfigError, WorkerError
from roboscale.rollout.inference import Prediction, PredictItem, RunnerSettings
from roboscale.rollout.predictor import Predictor
from roboscale.rollout.remote import RemotePolicy
from roboscale.serve.observation import ObservationLayout
from roboscale.serve.server import PolicyServer, ServerOptions
from roboscale.transport.websocket import connect
from tests.serve.conftest import running

CHUNK, ACTIONS = 3, 2


class FakePredictor:
    """A chunk that says which item it answers: every entry is seed + chunk index + the weights' version."""

    def __init__(self) -> None:
        self.version = 0
        self.batches: list[int] = []
        self.closed = False

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        self.batches.append(len(items))
        return [Prediction(np.full((CHUNK, ACTIONS), it.noise_seed + it.chunk_index + self.version, np.float32),
                           None, self.version) for it in items]

    def load_state(self, state, version: int) -> None:
        self.version = version

    def close(self) -> None:
        self.closed = True


def _layout() -> ObservationLayout:
    return ObservationLayout(cameras={"front": "cam/front"}, state=("joints",), prompt=("prompt",), state_dim=ACTIONS,
                             action_dim=ACTIONS, chunk_size=CHUNK, image_size=8)


def _item(slot: int, seed: int, chunk_index: int = 0) -> PredictItem:
    return PredictItem(slot, seed, chunk_index, "wave", np.zeros(ACTIONS, np.float32),
                       {"front": np.zeros((12, 10, 3), np.uint8)})


def test_the_websocket_server_serves_any_predictor_through_its_layout_and_metadata():
    fake = FakePredictor()
    server = PolicyServer(fake, _layout(), {"policy": "fake", "note": "no checkpoint"}, ServerOptions(port=0))
    with running(server) as (_, url):
        ws, metadata = connect(url)
        ws.close()
        assert metadata["policy"] == "fake" and metadata["note"] == "no checkpoint"
        assert metadata["keys"]["images"] == {"front": "cam/front"} and metadata["keys"]["state"] == ["joints"]
        remote = RemotePolicy(url)
        try:
            # two environments, two connections (batched together or not, as they happen to arrive)
            chunks = remote.predict([_item(0, seed=10), _item(1, seed=20, chunk_index=2)])
            assert [p.chunk[0, 0] for p in chunks] == [10, 22] and chunks[0].chunk.shape == (CHUNK, ACTIONS)
            assert sum(fake.batches) == 2
            fake.load_state({}, 5)  # the server predicts by whatever weights its predictor has now
            (later,) = remote.predict([_item(0, seed=10)])
            assert later.version == 5 and later.chunk[0, 0] == 15
            bad = _item(0, seed=1)
            bad.state = np.zeros(ACTIONS + 1, np.float32)
            with pytest.raises(WorkerError, match="'joints' has 3 values; this policy reads a state of 2"):
                remote.predict([bad])  # the layout's check, before the predictor is asked
            assert sum(fake.batches) == 3
        finally:
            remote.close()
    assert not fake.closed  # the server neither loads nor closes what it serves: its caller does


def test_the_server_refuses_to_listen_beyond_loopback_without_a_key():
    with pytest.raises(ConfigError, match="--host=0.0.0.0 listens beyond this machine"):
        ServerOptions(host="0.0.0.0")
    assert ServerOptions(host="0.0.0.0", api_key="k3y").api_key == "k3y"
    assert ServerOptions(host="::1").api_key is None and ServerOptions(host="localhost").host == "localhost"


def test_the_rollouts_predictors_are_predictors(checkpoint):
    runner = RunnerSettings(checkpoint, "cpu").build()
    for predictor in (runner, RemotePolicy("ws://127.0.0.1:9"), FakePredictor()):
        assert isinstance(predictor, Predictor), type(predictor).__name__
    runner.close()  # nothing to release, and callable
    assert not isinstance(object(), Predictor)
    with pytest.raises(WorkerError, match="cannot be published to a remote policy server"):
        RemotePolicy("ws://127.0.0.1:9").load_state({}, 1)
