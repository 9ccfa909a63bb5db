"""What the engine tests share: the toy env's setup, job lists, and a launcher that counts the processes started."""

from __future__ import annotations

from collections import Counter

from roboscale.rollout.engine import EnvSetup
from roboscale.rollout.episode import EpisodeJob
from roboscale.rollout.launch import LocalLauncher
from roboscale.sim.env import EnvRequest

FAKE = "tests.rollout.fake_envs:SPEC"


def setup_for(checkpoint: str, max_steps: int = 24) -> EnvSetup:
    cams = {"corner2": "corner2", "wrist": "wrist"}
    return EnvSetup(FAKE, checkpoint, n_action_steps=3,
                    request=EnvRequest(image_size=32, cameras=cams, max_steps=max_steps))


def jobs_for(tasks: list[str], episodes: int, **options) -> list[EpisodeJob]:
    return [EpisodeJob(t, i, seed=100 * k + i, **options) for k, t in enumerate(tasks) for i in range(episodes)]


def outcomes(results):
    return [(r.task, r.episode, r.success, r.steps) for r in results]


class CountingLauncher(LocalLauncher):
    """Local processes, counted by name (``rollout-server0``: how many times a server, and so its policy, was
    loaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: Counter[str] = Counter()

    def start(self, target, args, *, name, cpus=1.0, gpus=0.0):
        self.starts[name] += 1
        return super().start(target, args, name=name, cpus=cpus, gpus=gpus)
