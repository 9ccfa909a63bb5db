"""Every message of the engine crosses a real process boundary (a spawned process, multiprocessing queues) and comes
back as the same type with the same contents."""

from __future__ import annotations

import dataclasses
import queue

import numpy as np

from roboscale.rollout import messages as m
from roboscale.rollout.episode import EpisodeJob, EpisodeResult
from roboscale.rollout.inference import Prediction, PredictItem
from roboscale.rollout.launch import LocalLauncher
from roboscale.rollout.trajectory import ChunkRecord, Trajectory


def echo(inbox, outbox) -> None:
    """In the child: send back what comes, until Stop (which goes back too)."""
    while True:
        message = inbox.get(timeout=60)
        outbox.put(message)
        if isinstance(message, m.Stop):
            return


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def samples() -> list:
    rng = np.random.default_rng(0)
    images = {"corner2": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)}
    item = PredictItem(1, 77, 3, "Open a drawer", rng.standard_normal(4).astype(np.float32), images)
    chain = rng.standard_normal((4, 6, 4)).astype(np.float32)
    stochastic = np.array([False, True, False])
    density = rng.standard_normal((6, 4)).astype(np.float32)
    prediction = Prediction(chain[-1] * 2, chain, 5, stochastic, density)
    record = ChunkRecord(item.state, images, item.instruction, chain, stochastic, density, prediction.chunk, 2,
                         np.array([-0.5, -0.25], np.float32), 5)
    trajectory = Trajectory("reach", 0, 11, 12, [record], True, True)
    result = EpisodeResult("reach", 0, 11, True, 2, -0.75, -0.25).to_dict()
    return [
        m.Job(EpisodeJob("reach", 0, 11, noise_seed=12, record_trajectory=True), 1),
        m.LoadWeights(b"\x00safetensors bytes\xff", 5), m.Report(), m.Stop(),
        m.Predict(0, 3, [item]), m.Producing(1, 2), m.Actions(3, [m.Answer(1, 3, prediction), m.Answer(2, 0, Prediction(
            chain[0], None, 0))]),
        m.Ready("server0"), m.Alive("worker1"), m.Started("worker0", ("reach", 0), 1),
        m.Result("worker0", result, trajectory), m.Result("worker0", result, None),
        m.EpisodeFailed("worker0", ("reach", 1), "RuntimeError: diverged"), m.WeightsLoaded("server0", 5),
        m.Stats("worker0", {"env_steps": 2, "sim_s": 0.5}), m.Failed("server0", {"type": "CheckpointError",
                                                                                "message": "x: bad", "path": "x"}),
    ]


def test_every_message_round_trips_through_a_spawned_process():
    launcher = LocalLauncher()
    try:
        inbox, outbox = launcher.channel(), launcher.channel()
        child = launcher.start(echo, (inbox, outbox), name="echo")
        sent = [message for message in samples() if not isinstance(message, m.Stop)] + [m.Stop()]
        for message in sent:
            inbox.put(message)
        back = []
        while len(back) < len(sent):
            try:
                back.append(outbox.get(timeout=60))
            except queue.Empty:
                raise AssertionError(f"the echo process answered {len(back)} of {len(sent)} "
                                     f"({child.exit_reason()})") from None
        child.join(timeout=30)
        assert not child.alive()
    finally:
        launcher.close()
    defined = {kind for kind in vars(m).values()
               if isinstance(kind, type) and issubclass(kind, tuple) and kind.__module__ == m.__name__}
    assert {type(message) for message in sent} | {m.Answer} == defined  # every kind (Answer inside Actions)
    for before, after in zip(sent, back, strict=True):
        assert same(before, after), type(before).__name__


def test_messages_dispatch_on_their_type():
    def kind(message):
        match message:
            case m.Job(job, attempt):
                return f"job {job.key} attempt {attempt}"
            case m.Stop():
                return "stop"
            case m.Report():
                return "report"
        return "other"

    assert kind(m.Job(EpisodeJob("reach", 2, 0), 1)) == "job ('reach', 2) attempt 1"
    assert [kind(m.Stop()), kind(m.Report()), kind(m.Alive("w"))] == ["stop", "report", "other"]
