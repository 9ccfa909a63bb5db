"""The weight channel on its own (no processes): the latest state and its version, encoded once, published without
waiting, acknowledged to whoever waits, and a refused version leaving the last acknowledged one published."""

from __future__ import annotations

import threading

import pytest
import torch

from roboscale.errors import CheckpointError
from roboscale.rollout.weights import WeightChannel, decode_state


def test_the_latest_published_state_is_encoded_once_and_travels_as_safetensors():
    channel = WeightChannel()
    assert channel.version is None and channel.latest() is None
    channel.publish({"w": torch.arange(3.0)}, 1)
    channel.publish({"w": torch.arange(4.0)}, 2)
    latest = channel.latest()
    assert channel.version == 2 and latest.version == 2
    assert latest.data() is latest.data()  # one encoding, whatever the number of pools that load it
    assert torch.equal(decode_state(latest.data())["w"], torch.arange(4.0))
    with pytest.raises(ValueError, match="version 1 published after version 2"):
        channel.publish({"w": torch.zeros(1)}, 1)


def test_a_waiter_on_another_thread_is_told_once_the_engine_acknowledges():
    channel = WeightChannel()
    channel.publish({"w": torch.zeros(2)}, 3)
    assert not channel.wait_acknowledged(3, timeout=0.01)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(channel.wait_acknowledged(3, timeout=30)))
    waiter.start()
    channel.acknowledge(channel.latest())  # what the engine does once every process that predicts has them
    waiter.join(timeout=30)
    assert waited == [True]
    assert channel.wait_acknowledged(2, timeout=0)  # an older version: a later one is loaded


def test_refused_weights_leave_the_last_acknowledged_published_and_raise_for_their_waiters():
    channel = WeightChannel()
    channel.publish({"w": torch.zeros(2)}, 1)
    good = channel.latest()
    channel.acknowledge(good)
    channel.publish({"v": torch.zeros(2)}, 2)
    refusal = CheckpointError("published weights (version 2)", "1 tensors unexpected for this policy")
    channel.refuse(channel.latest(), refusal)
    assert channel.latest() is good and channel.version == 1
    with pytest.raises(CheckpointError, match="unexpected"):
        channel.wait_acknowledged(2, timeout=0)
    channel.publish({"w": torch.ones(2)}, 2)  # mended: published again
    assert not channel.wait_acknowledged(2, timeout=0)
