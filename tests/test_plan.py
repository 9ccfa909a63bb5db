"""`roboscale plan`: the scaling model's limits, its one-point prediction, the command's table and its errors."""

import math
from dataclasses import replace

import pytest

from roboscale.cli import main
from roboscale.plan import Cluster, Network, Workload, bytes_across_nodes, comm_seconds, plan_rows, predict_step_time

GPUS = [1, 2, 4, 8, 16, 64, 256, 1024]

# a 3B-parameter policy at ~10 TFLOP per sample (the shape of pi0.5 full), all weights trained
WORKLOAD = Workload(name="synthetic", flops_per_sample=1e13, params=3_000_000_000, trainable_params=3_000_000_000,
                    gather_bytes=6e9, backward_gather_bytes=6e9, grad_bytes=12e9, units=50, bytes_per_sample=5e5,
                    core_s_per_sample=1e-3)


def cluster(intra=360e9, inter=320e9, cores=96, latency=20e-6) -> Cluster:
    return Cluster(Network(ranks_per_node=8, intra_Bps=intra, inter_Bps=inter, latency_s=latency),
                   peak_flops=989.5e12, cores_per_node=cores)


@pytest.mark.parametrize("batch", [64, 1024, 4096])
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "ddp"])
def test_more_gpus_are_never_faster_than_perfect_scaling(batch, strategy):
    for c in (cluster(), cluster(intra=1e9, inter=1e8), cluster(cores=1)):
        rows = plan_rows(WORKLOAD, c, batch_size=batch, gpus=[n for n in GPUS if n <= batch], strategy=strategy)
        one = rows[0]
        assert one.gpus == 1 and one.comm_s == 0 and one.efficiency == pytest.approx(1.0)
        for row in rows:
            assert row.step_s >= one.step_s / row.gpus * (1 - 1e-12)
            assert row.efficiency <= 1 + 1e-12
            assert row.step_s >= max(row.compute_s, row.data_s)


def test_compute_bound_with_a_large_batch_per_gpu_and_fast_links():
    rows = plan_rows(WORKLOAD, cluster(), batch_size=64 * 1024, gpus=[8, 64, 1024])
    assert [r.bottleneck for r in rows] == ["compute"] * 3
    assert all(r.efficiency > 0.99 for r in rows)
    # compute per GPU: samples x FLOPs / (peak x MFU)
    assert rows[0].compute_s == pytest.approx(8 * 1024 * 1e13 / (989.5e12 * 0.4))


def test_network_bound_when_the_links_are_slow():
    rows = plan_rows(WORKLOAD, cluster(intra=1e9, inter=1e9), batch_size=1024, gpus=[8, 64, 1024])
    assert [r.bottleneck for r in rows] == ["network"] * 3
    assert all(r.comm_s > r.compute_s for r in rows)
    assert rows[-1].efficiency < rows[0].efficiency < 1


def test_rdma_only_matters_across_nodes():
    slow_rdma = cluster(inter=1e6)
    inside = plan_rows(WORKLOAD, slow_rdma, batch_size=1024, gpus=[8])[0]
    assert inside.bottleneck == "compute"
    across = plan_rows(WORKLOAD, slow_rdma, batch_size=1024, gpus=[16])[0]
    assert across.bottleneck == "network"


def test_data_bound_when_the_loader_cores_are_few():
    raw = replace(WORKLOAD, core_s_per_sample=0.1)  # 100 CPU-ms per sample: 10 samples/s per core
    rows = plan_rows(raw, cluster(cores=2), batch_size=1024, gpus=[8, 64])
    assert [r.bottleneck for r in rows] == ["data", "data"]
    for row in rows:
        assert row.available_per_node == pytest.approx(20)
        assert row.needed_per_node > row.available_per_node
        assert row.step_s == pytest.approx(row.data_s)


def test_one_step_of_cpu_processes_over_gloo():
    """What the 2-process CPU benchmark checks: compute halves, and FSDP moves (n-1)/n of the weights three times
    (gather for forward and backward, reduce-scatter the gradients) at the gloo bandwidth."""
    network = Network.single_host(ranks=2, Bps=1e9, latency_s=1e-4)
    one = predict_step_time(WORKLOAD, ranks=1, batch_size=32, network=network, peak_flops=1e11, mfu=0.5)
    two = predict_step_time(WORKLOAD, ranks=2, batch_size=32, network=network, peak_flops=1e11, mfu=0.5)
    assert one.comm_s == 0 and one.step_s == pytest.approx(32 * 1e13 / 5e10)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert two.comm_s == pytest.approx(0.5 * (6e9 + 6e9 + 12e9) / 1e9 + 3 * 50 * 1e-4)
    assert two.step_s == two.compute_s + two.comm_s  # no overlap by default (gloo shares the cores)
    measured = predict_step_time(WORKLOAD, ranks=2, batch_size=32, network=network, samples_per_s=4.0)
    assert measured.compute_s == pytest.approx(16 / 4.0)
    ddp = comm_seconds(WORKLOAD, 2, network, "ddp")
    assert ddp == pytest.approx(2 * 0.5 * 12e9 / 1e9 + 50 * 1e-4)


def test_hsdp_is_fsdp_inside_one_node_and_keeps_gathers_off_rdma_across_nodes():
    network = cluster(inter=10e9).network
    assert comm_seconds(WORKLOAD, 8, network, "hsdp") == comm_seconds(WORKLOAD, 8, network, "fsdp")
    assert comm_seconds(WORKLOAD, 64, network, "hsdp") < comm_seconds(WORKLOAD, 64, network, "fsdp")
    assert math.isclose(comm_seconds(WORKLOAD, 1, network, "hsdp"), 0)


def test_a_backend_s_own_collective_rates_and_its_reduce_scatter_traffic():
    """gloo on CPU: each collective at its own rate inside a node, and a reduce-scatter that moves an all-reduce's
    bytes (what benchmarks/multihost.py measured); the link bound stays the link's."""
    ring = Network(ranks_per_node=2, intra_Bps=1e9, inter_Bps=1e8)
    gloo = replace(ring, collective_Bps={"reduce_scatter": 0.5e9}, reduce_scatter_traffic=2.0)
    w = WORKLOAD
    # one node of 2: the reduce-scatter's share of FSDP's time is 2 (traffic) x 2 (half the rate) as long
    rs_ring = 0.5 * w.grad_bytes / 1e9
    assert comm_seconds(w, 2, gloo, "fsdp") - comm_seconds(w, 2, ring, "fsdp") == pytest.approx(3 * rs_ring)
    # across 2 nodes of 2 the link sets the pace: each collective's ring bytes over it, the reduce-scatter's twice
    across = 0.75 * (w.gather_bytes + w.backward_gather_bytes + 2 * w.grad_bytes) / 1e8
    assert comm_seconds(w, 4, gloo, "fsdp") == pytest.approx(across + 3 * w.units * gloo.latency_s)
    assert bytes_across_nodes(w, 4, gloo, "fsdp") == pytest.approx(2 * 0.75 * (6e9 + 6e9 + 2 * 12e9))
    assert bytes_across_nodes(w, 4, ring, "ddp") == pytest.approx(2 * 2 * 0.75 * 12e9)
    # HSDP: only the gradients' all-reduce between the 2 nodes, the node's ranks sharing its link
    assert bytes_across_nodes(w, 4, gloo, "hsdp") == pytest.approx(2 * 2 * 0.5 * 12e9)
    assert bytes_across_nodes(w, 2, gloo, "fsdp") == 0


def _plan(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_prints_a_table_per_gpu_count(capsys):
    code, out, err = _plan(capsys, "--policy.type=groot", "--policy.preset=full", "--batch_size=1024",
                           "--gpus=1,8,64,256,1024", "--gpu=h100", "--network.node_gbps=3200", "--paper_round")
    assert code == 0, err
    assert "groot (full): 2.40 B parameters" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "8", "64", "256", "1,024"]
    assert all(row.rstrip(" |").split("|")[-1].strip() in ("compute", "network", "data") for row in rows)
    assert "Seed paper's round" in out and "40x" in out


def test_the_command_takes_a_small_preset_and_the_policy_options(capsys):
    code, out, err = _plan(capsys, "--policy.type", "pi05", "--policy.preset", "tiny", "--policy.depth=3",
                           "--gpus", "1", "2", "--batch_size=8", "--precision=fp8", "--data.source=raw")
    assert code == 0, err
    assert out.startswith("pi05 (tiny):") and "fp8" in out


@pytest.mark.parametrize("args, message", [
    (["--gpus=12"], "--gpus: 12 is not a whole number of 8-GPU nodes"),
    (["--gpus=2048"], "--gpus: 2048 GPUs exceed --batch_size=1024"),
    (["--strategy=zero3"], "--strategy must be one of fsdp, hsdp, ddp"),
    (["--policy.preset=huge"], "policy 'pi05' has no preset 'huge'"),
    (["--gpu=tpu-v5"], "--gpu: unknown GPU 'tpu-v5'"),
    (["--network.efficiency=2"], "--network.efficiency must be in (0, 1]"),
    (["--mfu=0"], "--mfu must be in (0, 1]"),
])
def test_a_bad_option_is_one_line_naming_it(capsys, args, message):
    code, _, err = _plan(capsys, *args)
    assert code == 2
    assert err.strip().splitlines() == [f"error: {err.strip().removeprefix('error: ')}"]
    assert message in err
