"""torchrun across hosts of the cluster in a box, as the README's multi-node command runs it: a c10d rendezvous on
host 0's name, gloo on each host's eth0. Two hosts of one rank compute the 1-process losses (DDP and FSDP2); a
link cut mid-run ends every rank and both torchruns within ``--parallel.timeout_s`` plus a bound, never a hang,
on hosts whose ``net.ipv4.tcp_retries2`` is 5 (with the kernel's 15 the cut host's agent blocks in its
rendezvous-store call for ~15 minutes: README, "Clusters")."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roboscale.testing.cluster import Cluster, available
from tests.train.test_distributed import STEPS, _command, _losses, _train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(available()), reason=available() or "")]

ROOT = Path(__file__).resolve().parents[2]
PORT = 29431
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING", "GLOO_SOCKET_IFNAME": "eth0",
       "PYTHONPATH": str(ROOT / "src")}


def torchrun(cluster: Cluster, dataset: Path, out: Path, *extra: str, ranks_per_host: int = 1, nnodes: str = "",
             torchrun_options: tuple[str, ...] = (), env: dict[str, str] = ENV) -> list[str]:
    """`roboscale train` under torchrun as each host runs it: ``--nnodes`` (default: the hosts), rendezvous at
    host0."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or len(cluster.hosts)}",
            f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{PORT}",
            f"--rdzv-id={cluster.name}", *torchrun_options]
    train = _command(2, dataset, out, *extra)[len([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node=2"]):]
    return [*head, *train]


def on_hosts(cluster: Cluster, dataset: Path, out: Path, *extra: str, ranks_per_host: int = 1
             ) -> list[subprocess.Popen]:
    """`roboscale train` on every host: torchrun with ``--nnodes`` = the hosts, rendezvous at host0."""
    argv = torchrun(cluster, dataset, out, *extra, ranks_per_host=ranks_per_host)
    return [host.popen(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            for host in cluster.hosts]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses(_train(1, tiny_dataset, tmp_path_factory.mktemp("one") / "run"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_hosts_compute_the_one_process_losses(strategy: str, single: list[float], tiny_dataset: Path,
                                                  tmp_path: Path) -> None:
    with Cluster(2) as cluster:
        procs = on_hosts(cluster, tiny_dataset, tmp_path / "run", f"--parallel.strategy={strategy}")
        errors = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    rows = metrics(tmp_path / "run")
    assert len(rows) == STEPS and _losses(rows) == pytest.approx(single, rel=1e-4)


def test_a_cut_link_ends_every_process_within_the_collective_timeout(tiny_dataset: Path, tmp_path: Path) -> None:
    timeout_s, bound_s = 20, 30
    out = tmp_path / "run"
    with Cluster(2, tcp_retries2=5) as cluster:
        procs = on_hosts(cluster, tiny_dataset, out, "--parallel.strategy=fsdp", f"--parallel.timeout_s={timeout_s}",
                         "--steps=100000", "--save_freq=100000")
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file():  # training has begun: a step's collectives are in flight
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.5)
        cut = time.monotonic()
        cluster.cut(cluster.hosts[1])
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, timeout_s + bound_s - (time.monotonic() - cut)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a torchrun still ran {timeout_s + bound_s} s after host1's link was cut")
        ended_s = time.monotonic() - cut
    assert all(p.returncode != 0 for p in procs)  # a failure, said: not a hang, not a success
    assert ended_s < timeout_s + bound_s, ended_s


def _mesh(out: Path) -> list[int]:
    """[replicate, shard] of the run's last checkpoint (trainer_state.json)."""
    last = out / "checkpoints" / os.readlink(out / "checkpoints" / "last")
    return json.loads((last / "training_state" / "trainer_state.json").read_text())["mesh"]


@pytest.mark.cluster
def test_two_hosts_of_two_ranks_compute_the_one_process_losses_and_hsdp_shards_within_a_host(
        single: list[float], tiny_dataset: Path, tmp_path: Path) -> None:
    meshes, crossed = {}, {}
    for strategy in ("ddp", "fsdp", "hsdp"):
        out = tmp_path / strategy
        with Cluster(2) as cluster:
            procs = on_hosts(cluster, tiny_dataset, out, f"--parallel.strategy={strategy}", ranks_per_host=2)
            errors = [p.communicate(timeout=600)[1] for p in procs]
            assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
            crossed[strategy] = cluster.bytes_through(cluster.hosts[1])
        assert _losses(metrics(out)) == pytest.approx(single, rel=1e-4), strategy
        meshes[strategy] = _mesh(out)
    # HSDP shards within a host (its 2 ranks) and replicates across the hosts: its default mesh, and what crosses
    # the link between them -- one all-reduce of the gradients' shards, against FSDP2's all-gathers and
    # reduce-scatter of everything over all 4 ranks (~0.37x, measured)
    assert meshes == {"ddp": [4, 1], "fsdp": [1, 4], "hsdp": [2, 2]}
    assert crossed["hsdp"] < 0.6 * crossed["fsdp"], crossed


ELASTIC_STEPS = 80


def _wait_until(condition, what: str, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 240.0
                ) -> None:
    """Poll (bounded) until ``condition()``; a torchrun that ended meanwhile is the failure, with the logs."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs if log.is_file())
            pytest.fail(f"{'a torchrun ended ' + str(ended) if ended else 'timed out'} waiting for {what}\n{tails}")
        time.sleep(0.1)


def _last_step(out: Path) -> int:
    last = out / "checkpoints" / "last"
    return int(os.readlink(last)) if last.is_symlink() else 0


@pytest.mark.cluster
def test_a_lost_host_leaves_the_other_to_resume_alone_and_a_rejoining_host_widens_the_run_again(
        tiny_dataset: Path, tmp_path: Path) -> None:
    """`--nnodes=1:2`: host1's processes killed mid-run, host0's agent restarts its rank and resumes at world
    size 1 from the last checkpoint; host1 started again, host0's agent sees it waiting and both resume at 2.
    The run's record is then the uninterrupted 1-process run's (metrics cut back on each resume; losses do not
    depend on the world size, so a 1-host run resumed from the same checkpoint computes the same)."""
    single = _losses(_train(1, tiny_dataset, tmp_path / "single", f"--steps={ELASTIC_STEPS}"))
    out = tmp_path / "run"
    # the rank-0 agent of a later round writes that round's MASTER_ADDR only without the shared TCP store (torch
    # 2.13): with it, a rejoining host waits for the key until the rendezvous times out (README, "Clusters")
    env = {**ENV, "ROBOSCALE_LOG": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Cluster(2) as cluster:
        # last_call_timeout: how long a rendezvous that has its minimum waits for more (30 s by default)
        argv = torchrun(cluster, tiny_dataset, out, f"--steps={ELASTIC_STEPS}", nnodes="1:2",
                        torchrun_options=("--max-restarts=3", "--rdzv-conf=last_call_timeout=2"))
        logs = [tmp_path / "host0.log", tmp_path / "host1.log", tmp_path / "host1-again.log"]

        def start(host, log: Path) -> subprocess.Popen:
            with log.open("w") as stderr:
                return host.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)

        procs = [start(cluster.hosts[0], logs[0]), start(cluster.hosts[1], logs[1])]
        _wait_until(lambda: _last_step(out) >= 4, "checkpoint 4", procs, logs)
        cluster.hosts[1].kill_all()
        procs[1].wait(timeout=30)
        alone = re.compile(r"at step (\d+) \(saved by 2 ranks, now 1\)")
        _wait_until(lambda: alone.search(logs[0].read_text()), "host0 resuming alone", procs[:1], logs)
        kept = int(alone.search(logs[0].read_text())[1])
        assert 4 <= kept < ELASTIC_STEPS
        _wait_until(lambda: _last_step(out) > kept, "a checkpoint of the 1-rank run", procs[:1], logs)

        procs[1] = start(cluster.hosts[1], logs[2])
        widened = re.compile(r"at step (\d+) \(saved by 1 ranks, now 2\)")
        _wait_until(lambda: widened.search(logs[0].read_text()), "both hosts resuming together", procs, logs)
        assert kept < int(widened.search(logs[0].read_text())[1]) < ELASTIC_STEPS
        for proc in procs:
            proc.wait(timeout=300)
        assert [p.returncode for p in procs] == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, ELASTIC_STEPS + 1))
    assert _losses(rows) == pytest.approx(single, rel=1e-4)
