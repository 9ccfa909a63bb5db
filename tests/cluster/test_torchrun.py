"""torchrun across hosts of the cluster in a box, as the README's multi-node command runs it: a c10d rendezvous on
host 0's name, gloo on each host's eth0. Two hosts of one rank compute the 1-process losses (DDP and FSDP2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roboscale.testing.cluster import Cluster, available
from tests.train.test_distributed import STEPS, _command, _losses, _train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(available()), reason=available() or "")]

ROOT = Path(__file__).resolve().parents[2]
PORT = 29431
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING", "GLOO_SOCKET_IFNAME": "eth0",
       "PYTHONPATH": str(ROOT / "src")}


def on_hosts(cluster: Cluster, dataset: Path, out: Path, *extra: str, ranks_per_host: int = 1
             ) -> list[subprocess.Popen]:
    """`roboscale train` on every host: torchrun with ``--nnodes`` = the hosts, rendezvous at host0."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(cluster.hosts)}",
            f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{PORT}",
            f"--rdzv-id={cluster.name}"]
    train = _command(2, dataset, out, *extra)[len([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node=2"]):]
    return [host.popen([*head, *train], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       cwd=ROOT) for host in cluster.hosts]


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
