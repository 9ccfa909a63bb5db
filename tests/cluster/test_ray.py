"""Ray across hosts of the cluster in a box (``roboscale.testing.ray``): a head on host0 and a worker node on host1,
each `ray start`ed in its own namespace, bound to its host's address, with token authentication.

- `lake build --ray-address` runs shards on both hosts and writes the bytes of a one-node build; host1's raylet
  killed while it builds a shard, the build still finishes with every shard once;
- `train --launcher=ray` places one worker per host and computes the one-process losses; host1's raylet killed
  mid-run, Ray Train restarts the workers (on host0) and they resume to the uninterrupted run's losses;
- the rollout engine's env workers (and `roboscale rl`'s generators) on host1, the driver (the trainer) on host0:
  the episodes and losses of local processes; host1's raylet killed mid-evaluation and the host brought back, the
  engine reruns the lost episodes there, to the same results.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from roboscale.testing.cluster import Cluster, Host, available
from tests.conftest import tiny_policy_args
from tests.train.test_distributed import _command, _losses, _train

pytest.importorskip("ray")
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.skipif(bool(available()), reason=available() or "")]

from roboscale.testing.ray import RayCluster  # noqa: E402 - after the skip: it needs nothing, but reads as Ray's

ROOT = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "INFO",
       "PYTHONPATH": str(ROOT / "src")}
LAKE_SHARD_FRAMES = 30
"""The tiny dataset's episodes are 30 frames: one shard each."""


def run_on(host: Host, ray_cluster: RayCluster, argv: list[str], log: Path) -> subprocess.Popen:
    """``argv`` on ``host`` as a user's shell there runs it (Ray's token in its environment); output to ``log``."""
    with log.open("w") as out:
        return host.popen(argv, env={**ENV, **ray_cluster.env}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> str:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def wait_until(condition: Callable[[], bool], what: str, proc: subprocess.Popen, log: Path,
               timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{'it ended' if proc.poll() is not None else 'timed out'} waiting for {what}:\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.05)


def running_on(host: Host, name: str) -> bool:
    """A Ray worker process on ``host`` is running a task or actor method named ``name`` (Ray sets a worker's
    process title to ``ray::NAME`` while it runs it, ``ray::IDLE`` otherwise)."""
    for pid in host.pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::") and name in title:
            return True
    return False


def lake_files(lake: Path) -> dict[str, bytes]:
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted(lake.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}


# ------------------------------------------------------------------------------------------------------ lake


@pytest.fixture(scope="module")
def one_node_lake(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("lake") / "one-node"
    done = subprocess.run([sys.executable, "-m", "roboscale", "lake", "build", str(tiny_dataset), "--output",
                           str(out), f"--shard-frames={LAKE_SHARD_FRAMES}", "--num-cpus=2"],
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return lake_files(out)


def lake_build(tiny_dataset: Path, out: Path, ray_cluster: RayCluster) -> list[str]:
    return [sys.executable, "-m", "roboscale", "lake", "build", str(tiny_dataset), "--output", str(out),
            f"--shard-frames={LAKE_SHARD_FRAMES}", "--ray-address", ray_cluster.address]


def test_a_lake_build_runs_shards_on_both_hosts_and_writes_the_bytes_of_a_one_node_build(
        one_node_lake: dict[str, bytes], tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2) as ray_cluster:
        log = tmp_path / "build.log"
        text = finish(run_on(cluster.hosts[0], ray_cluster, lake_build(tiny_dataset, out, ray_cluster), log), log)
        assert "Connecting to existing Ray cluster" in text
        assert [ray_cluster.ran_on(host, "BuildShardTask") for host in cluster.hosts] == [True, True]
    assert lake_files(out) == one_node_lake


def test_a_lake_build_that_loses_a_host_mid_shard_finishes_with_every_shard_once(
        one_node_lake: dict[str, bytes], tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2) as ray_cluster:
        log = tmp_path / "build.log"
        build = run_on(cluster.hosts[0], ray_cluster, lake_build(tiny_dataset, out, ray_cluster), log)
        wait_until(lambda: running_on(cluster.hosts[1], "BuildShardTask"), "a shard building on host1", build, log)
        ray_cluster.kill_raylet(cluster.hosts[1])
        assert build.poll() is None  # killed while the build ran, a shard in progress on host1
        finish(build, log)
    assert lake_files(out) == one_node_lake


# ----------------------------------------------------------------------------------------------------- train

STEPS = 6
ELASTIC_STEPS = 30


def ray_train(tiny_dataset: Path, out: Path, ray_cluster: RayCluster, *extra: str) -> list[str]:
    argv = _command(1, tiny_dataset, out, *extra)
    return [*argv, "--launcher=ray", "--ray.num_workers=2", "--ray.cpus_per_worker=1",
            f"--ray.address={ray_cluster.address}"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_ray_train_places_one_worker_per_host_and_computes_the_one_process_losses(tiny_dataset: Path,
                                                                                tmp_path: Path) -> None:
    single = _losses(_train(1, tiny_dataset, tmp_path / "single"))
    out = tmp_path / "run"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2) as ray_cluster:
        log = tmp_path / "train.log"
        finish(run_on(cluster.hosts[0], ray_cluster,
                      ray_train(tiny_dataset, out, ray_cluster, "--ray.placement_strategy=STRICT_SPREAD"), log), log)
        assert [ray_cluster.ran_on(host, "RayTrainWorker") for host in cluster.hosts] == [True, True]
    rows = metrics(out)
    assert len(rows) == STEPS and _losses(rows) == pytest.approx(single, rel=1e-4)


def test_ray_train_that_loses_a_host_restarts_and_resumes_to_the_uninterrupted_losses(tiny_dataset: Path,
                                                                                    tmp_path: Path) -> None:
    single = _losses(_train(1, tiny_dataset, tmp_path / "single", f"--steps={ELASTIC_STEPS}"))
    out = tmp_path / "run"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2) as ray_cluster:
        log = tmp_path / "train.log"
        # SPREAD: one worker per host while both are up, both on host0 once host1 is gone
        proc = run_on(cluster.hosts[0], ray_cluster, ray_train(tiny_dataset, out, ray_cluster,
                                                                f"--steps={ELASTIC_STEPS}",
                                                                "--ray.placement_strategy=SPREAD"), log)
        last = out / "checkpoints" / "last"
        wait_until(lambda: last.is_symlink() and int(os.readlink(last)) >= 4, "checkpoint 4", proc, log)
        assert running_on(cluster.hosts[1], "RayTrainWorker")
        ray_cluster.kill_raylet(cluster.hosts[1])
        text = finish(proc, log)
        resumed = re.search(r"resumed from .* at step (\d+) \(saved by 2 ranks, now 2\)", text)
        assert resumed and 4 <= int(resumed[1]) < ELASTIC_STEPS, text[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, ELASTIC_STEPS + 1))
    assert _losses(rows) == pytest.approx(single, rel=1e-4)


# --------------------------------------------------------------------------------------------------- rollout

EPISODES = 8
SIM = {"sim": 4}
"""host1's custom resource: the rollout's processes ask for it (--rollout.ray_resources), so they run there."""


def episodes(out: Path) -> list[tuple]:
    report = json.loads((out / "report.json").read_text())
    return [(e["task"], e["episode"], e["seed"], e["steps"], e["success"], round(e["sum_reward"], 4))
            for e in report["episodes"]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.helpers import tiny_policy

    path = tmp_path_factory.mktemp("ckpt") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return path


def evaluation(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "roboscale", "eval", f"--checkpoint={checkpoint}", "--tasks=[reach]",
            f"--episodes={EPISODES}", "--max_steps=100", "--videos_per_task=0", "--rollout.workers=2",
            "--rollout.envs_per_worker=1", "--rollout.runner.max_batch_size=1", "--rollout.runner.threads=1",
            f"--output_dir={out}", *extra]


@pytest.fixture(scope="module")
def local_episodes(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    out = tmp_path_factory.mktemp("eval") / "local"
    done = subprocess.run(evaluation(checkpoint, out), env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return episodes(out)


def on_host1(ray_cluster: RayCluster) -> list[str]:
    return [f"--rollout.ray_address={ray_cluster.address}", f"--rollout.ray_resources={json.dumps({'sim': 1})}",
            "--rollout.worker_cpus=0.5"]


def test_env_workers_on_another_host_give_the_local_episodes(checkpoint: Path, local_episodes: list[tuple],
                                                             tmp_path: Path) -> None:
    out = tmp_path / "eval"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2, resources={1: SIM}) as ray_cluster:
        log = tmp_path / "eval.log"
        finish(run_on(cluster.hosts[0], ray_cluster, evaluation(checkpoint, out, *on_host1(ray_cluster)), log), log)
        assert [ray_cluster.ran_on(host, "rollout-worker") for host in cluster.hosts] == [False, True]
    assert episodes(out) == local_episodes


def test_a_lost_simulation_host_s_episodes_are_rerun_when_it_is_back(checkpoint: Path, local_episodes: list[tuple],
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "eval"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2, resources={1: SIM}) as ray_cluster:
        log = tmp_path / "eval.log"
        proc = run_on(cluster.hosts[0], ray_cluster, evaluation(checkpoint, out, *on_host1(ray_cluster)), log)
        some_done = re.compile(rf"evaluating: .* [1-{EPISODES - 2}]/{EPISODES} ")
        wait_until(lambda: some_done.search(log.read_text()), "the first episodes' results", proc, log)
        ray_cluster.kill_raylet(cluster.hosts[1])
        ray_cluster.wait_for_nodes(1)  # the GCS has marked host1 dead
        assert proc.poll() is None  # killed with episodes in flight on host1
        ray_cluster.start_node(cluster.hosts[1])  # the host back, as a cluster manager would bring it
        text = finish(proc, log)
        assert re.search(r"restarting the rollout workers: worker\d: the env worker died", text), text[-3000:]
    assert episodes(out) == local_episodes


def test_rl_generators_and_simulators_on_another_host_compute_the_local_losses(tiny_dataset: Path,
                                                                              tmp_path: Path) -> None:
    sft = tmp_path / "sft"
    _train(1, tiny_dataset, sft, "--steps=2", "--batch_size=4", policy=tiny_policy_args("pi05", chunk_size=4,
                                                                                         n_action_steps=2))
    rl = [sys.executable, "-m", "roboscale", "rl", f"--policy_path={sft}", "--tasks=[reach]", "--rl.group_size=2",
          "--rl.max_steps=12", "--rollout.envs_per_worker=2", "--rollout.runner.max_batch_size=1",
          "--rollout.runner.threads=1", "--log_freq=1", "--optimizer.lr=1e-3", "--steps=2",
          "--rollout.inference=server", "--rl.mode=async"]
    local = subprocess.run([*rl, f"--output_dir={tmp_path / 'local'}"], env={**os.environ, **ENV},
                           capture_output=True, text=True, timeout=900, check=False)
    assert local.returncode == 0, local.stderr[-3000:]
    out = tmp_path / "rl"
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2, resources={1: SIM}) as ray_cluster:
        log = tmp_path / "rl.log"
        finish(run_on(cluster.hosts[0], ray_cluster, [*rl, f"--output_dir={out}", *on_host1(ray_cluster)], log), log)
        placed = {name: [ray_cluster.ran_on(host, name) for host in cluster.hosts]
                  for name in ("rollout-server", "rollout-worker")}
        assert placed == {"rollout-server": [False, True], "rollout-worker": [False, True]}

    def losses(run: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return {row["step"]: row["loss"] for row in rows if "loss" in row}

    assert losses(out) == pytest.approx(losses(tmp_path / "local"), rel=1e-5)


# ------------------------------------------------------------------------------------------------------ jobs


def test_the_example_submits_a_training_and_an_rl_run_as_ray_jobs(tiny_dataset: Path, tmp_path: Path) -> None:
    """examples/ray/submit.sh from host1, as a user's shell on another machine runs it: `ray job submit` to the
    head's job server on host0; the training's workers on both hosts, then RL from its checkpoint with the
    rollout's processes on host1 (its custom resource)."""
    single = _losses(_train(1, tiny_dataset, tmp_path / "single"))
    train_out, rl_out = tmp_path / "train", tmp_path / "rl"
    script = str(ROOT / "examples" / "ray" / "submit.sh")
    with Cluster(2) as cluster, RayCluster(cluster, cpus=2, resources={1: SIM}, dashboard=True) as ray_cluster:
        submitter = cluster.hosts[1]
        env = {**ENV, **ray_cluster.env, "RAY_ADDRESS": ray_cluster.dashboard_url,
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               "ROBOSCALE": str(Path(sys.executable).with_name("roboscale"))}
        train_args = _command(1, tiny_dataset, train_out)[4:]  # `roboscale train`'s options
        train_args = [a for a in train_args if not a.startswith(("--dataset.root=", "--output_dir="))]
        done = submitter.run([script, "train", *train_args, "--ray.cpus_per_worker=1"],
                             env={**env, "DATASET": str(tiny_dataset), "OUTPUT_DIR": str(train_out),
                                  "PLACEMENT": "STRICT_SPREAD", "JOB_ID": "train-1"},
                             capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0 and "Job 'train-1' succeeded" in done.stdout, done.stdout[-3000:] + done.stderr
        assert [ray_cluster.ran_on(host, "RayTrainWorker") for host in cluster.hosts] == [True, True]

        rl_args = ["--tasks=[reach]", "--rl.group_size=2", "--rl.max_steps=12", "--rollout.envs_per_worker=2",
                   "--rollout.worker_cpus=0.5", "--steps=2", "--log_freq=1"]
        done = submitter.run([script, "rl", *rl_args],
                             env={**env, "POLICY": str(train_out), "OUTPUT_DIR": str(rl_out),
                                  "ROLLOUT_RESOURCES": json.dumps({"sim": 1}), "JOB_ID": "rl-1"},
                             capture_output=True, text=True, timeout=900, cwd=ROOT)
        assert done.returncode == 0 and "Job 'rl-1' succeeded" in done.stdout, done.stdout[-3000:] + done.stderr
        assert [ray_cluster.ran_on(host, "rollout-worker") for host in cluster.hosts] == [False, True]
    assert _losses(metrics(train_out)) == pytest.approx(single, rel=1e-4)
    assert [row["step"] for row in metrics(rl_out) if "loss" in row] == [1, 2]
