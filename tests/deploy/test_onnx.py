"""`roboscale export --format=onnx` and what runs it: parity with PyTorch (batch 1 and 8, guided), the ONNX
Runtime predictor behind `roboscale serve` and `roboscale eval`, the standalone client, and bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from roboscale.configs.model import OnnxExportOptions
from roboscale.errors import CheckpointError, ConfigError
from roboscale.rollout.inference import PredictItem, RunnerSettings
from roboscale.train.export import export_checkpoint
from tests.models.helpers import tiny_policy

pytest.importorskip("onnxruntime")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("onnx") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def exported(checkpoint: Path) -> Path:
    """The tiny pi0.5 exported with every graph (the unrolled one too)."""
    return export_checkpoint(checkpoint, checkpoint.parent / "onnx", "onnx", OnnxExportOptions())


def _items(n: int, committed_every: int = 0) -> list[PredictItem]:
    rng = np.random.default_rng(n)
    items = []
    for i in range(n):
        committed = rng.normal(size=(3 + i % 3, 4)).astype(np.float32) if committed_every and i % committed_every else None
        items.append(PredictItem(i, 100 + i, i % 3, ["Open a drawer", "Rotate the faucet clockwise"][i % 2],
                                 rng.uniform(-1, 1, 4).astype(np.float32),
                                 {"corner2": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8),
                                  "wrist": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)},
                                 committed=committed, delay=min(2, len(committed)) if committed is not None else 0))
    return items


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("graph", ["split", "chunk"])
def test_the_onnx_predictor_gives_pytorchs_chunks(checkpoint: Path, exported: Path, batch: int, graph: str) -> None:
    """The same items (observation, prompt, the episode's noise) give PyTorch's chunks within 1e-4 relative, from
    the split graphs and from the unrolled one."""
    from roboscale.rollout.onnx import OnnxPredictor

    items = _items(batch)
    expected = [p.chunk for p in RunnerSettings(str(checkpoint), "cpu").build().predict(items)]
    actual = [p.chunk for p in OnnxPredictor(str(exported), "cpu", graph=graph).predict(items)]
    assert _relative(np.stack(actual), np.stack(expected)) < 1e-4
    assert all(a.shape == (6, 4) and a.dtype == np.float32 for a in actual)


def test_real_time_chunking_guides_the_onnx_chunks_as_pytorch_does(checkpoint: Path, exported: Path) -> None:
    """Items with committed actions (real-time chunking) go through the guided graph, whose vector-Jacobian
    product was traced into it; the others are predicted apart, as PolicyRunner does."""
    from roboscale.rollout.onnx import OnnxPredictor

    items = _items(8, committed_every=2)
    assert any(it.committed is None for it in items) and any(it.committed is not None for it in items)
    expected = np.stack([p.chunk for p in RunnerSettings(str(checkpoint), "cpu").build().predict(items)])
    actual = np.stack([p.chunk for p in OnnxPredictor(str(exported), "cpu").predict(items)])
    assert _relative(actual, expected) < 1e-4
    unguided = np.stack([p.chunk for p in OnnxPredictor(str(exported), "cpu").predict(
        [PredictItem(**{**it.__dict__, "committed": None, "delay": 0}) for it in items])])
    guided_rows = [i for i, it in enumerate(items) if it.committed is not None]
    assert np.abs(actual[guided_rows] - unguided[guided_rows]).max() > 1e-3  # the guidance did something


def test_the_exported_directory_holds_what_a_client_needs(exported: Path) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["format"] == "roboscale-onnx" and config["opset"] >= 17
    assert sorted(config["graphs"]) == ["chunk", "denoise", "denoise_guided", "encoder"]
    inputs = {i["name"]: i for i in config["graphs"]["encoder"]["inputs"]}
    assert list(inputs) == ["images", "state", "tokens", "token_mask"]
    assert inputs["images"]["dtype"] == "uint8" and isinstance(inputs["images"]["shape"][0], str)  # dynamic batch
    assert inputs["images"]["shape"][1:] == [2, 3, 32, 32]
    for name in ("tokenizer.json", "normalization.json"):
        assert (exported / name).is_file()
    assert len(config["source"]["weights_sha256"]) == 64


def test_the_standalone_client_runs_without_torch(checkpoint: Path, exported: Path, tmp_path: Path) -> None:
    """examples/onnx_client.py with torch (and roboscale) made unimportable: onnxruntime, numpy and tokenizers
    alone give PyTorch's chunk."""
    from roboscale.rollout.inference import PolicyRunner

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\nsys.modules['roboscale'] = None\n")
    item = _items(1)[0]
    np.save(tmp_path / "corner2.npy", item.images["corner2"])
    np.save(tmp_path / "wrist.npy", item.images["wrist"])
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "onnx_client.py"), str(exported),
                          "--prompt", item.instruction, "--state", ",".join(map(str, item.state.tolist())),
                          "--image", f"observation.images.corner2={tmp_path / 'corner2.npy'}",
                          "--image", f"observation.images.wrist={tmp_path / 'wrist.npy'}",
                          "--seed", str(item.noise_seed), "--chunk-index", str(item.chunk_index),
                          "--output", str(tmp_path / "actions.npy")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = PolicyRunner(str(checkpoint), "cpu").predict([item])[0].chunk
    assert _relative(np.load(tmp_path / "actions.npy"), expected) < 1e-4


def test_serve_with_the_onnx_backend_answers_pytorchs_chunk(checkpoint: Path, exported: Path) -> None:
    from tests.serve.conftest import observation, served
    from tests.serve.test_server import ask, client

    with served(checkpoint=str(exported), backend="onnx") as (_, url):
        ws, metadata = client(url)
        with ws:
            assert metadata["backend"] == "onnx" and metadata["policy"] == "pi05"
            assert metadata["checkpoint_sha256"] == json.loads((exported / "config.json").read_text())[
                "source"]["weights_sha256"]
            reply = ask(ws, observation(seed=3))
            bad = ask(ws, observation(seed=3, **{"observation.state": np.zeros(7, np.float32)}))
    obs = observation(seed=3)
    item = PredictItem(0, 3, 0, "Open a drawer", obs["observation.state"],
                       {"corner2": obs["observation.images.corner2"], "wrist": obs["observation.images.wrist"]})
    expected = RunnerSettings(str(checkpoint), "cpu").build().predict([item])[0].chunk
    assert _relative(reply["actions"], expected) < 1e-4
    assert isinstance(bad, str) and "observation.state" in bad  # the server's own input checks, as for torch


def test_eval_with_the_onnx_backend_runs_the_same_episodes(checkpoint: Path, exported: Path,
                                                          tmp_path: Path) -> None:
    from roboscale.configs.eval import EvalConfig, EvalPolicy
    from roboscale.configs.rollout import RolloutConfig
    from roboscale.eval.closed_loop import evaluate

    results, weights = {}, {}
    for backend, path in (("torch", checkpoint), ("onnx", exported)):
        cfg = EvalConfig(checkpoint=str(path), tasks=["reach"], episodes=2, max_steps=12, videos_per_task=0,
                         output_dir=str(tmp_path / backend), policy=EvalPolicy(backend),
                         rollout=RolloutConfig(workers=1, envs_per_worker=2, sub_batches=1))
        evaluate(cfg, progress=False)
        report = json.loads((tmp_path / backend / "report.json").read_text())
        results[backend] = [(e["episode"], e["success"], e["steps"], round(e["sum_reward"], 3))
                            for e in map(json.loads, (tmp_path / backend / "episodes.jsonl").read_text().splitlines())]
        weights[backend] = report["checkpoint_sha256"]
    assert weights["onnx"] == weights["torch"]  # the report names the weights, whichever backend ran them
    assert sorted(results["onnx"]) == sorted(results["torch"])
    assert json.loads((tmp_path / "onnx" / "report.json").read_text())["protocol"]["backend"] == "onnx"


# --- bad input ------------------------------------------------------------------------------------------------
def test_an_attention_kernel_onnx_cannot_express_names_the_option_that_avoids_it(tmp_path: Path) -> None:
    path = tmp_path / "varlen"
    tiny_policy(attention_backend="varlen").save_pretrained(path)
    with pytest.raises(ConfigError, match=r"attention_backend=varlen.*--onnx\.attention_backend=sdpa"):
        export_checkpoint(path, tmp_path / "out", "onnx")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["missing graph", "other graph", "inputs", "not json"])
def test_a_directory_whose_files_do_not_match_its_config_is_a_one_line_error(exported: Path, tmp_path: Path,
                                                                               damage: str) -> None:
    from roboscale.rollout.onnx import OnnxPredictor

    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    config = json.loads((broken / "config.json").read_text())
    if damage == "missing graph":
        (broken / "denoise.onnx").unlink()
    elif damage == "other graph":
        shutil.copy(broken / "denoise_guided.onnx", broken / "denoise.onnx")
    elif damage == "inputs":
        config["graphs"]["denoise"]["inputs"][0]["name"] = "noisy"
        (broken / "config.json").write_text(json.dumps(config))
    else:
        (broken / "config.json").write_text("{")
    with pytest.raises(CheckpointError) as error:
        OnnxPredictor(str(broken), "cpu")
    message = str(error.value)
    assert "\n" not in message and str(broken) in message


def test_the_predictor_checks_what_it_is_given(exported: Path) -> None:
    from roboscale.deploy.runtime import OnnxPolicy

    model = OnnxPolicy(exported)
    images = {"observation.images.corner2": np.zeros((1, 32, 32, 3), np.uint8),
              "observation.images.wrist": np.zeros((1, 32, 32, 3), np.uint8)}
    noise = np.zeros((1, 6, 4), np.float32)
    with pytest.raises(ValueError, match=r"state: expected float \[batch, 4\]"):
        model.predict(images, np.zeros((1, 5), np.float32), ["go"], noise)
    with pytest.raises(ValueError, match="no 'observation.images.wrist'"):
        model.predict({"observation.images.corner2": images["observation.images.corner2"]},
                      np.zeros((1, 4), np.float32), ["go"], noise)
    with pytest.raises(ValueError, match=r"images\['observation.images.corner2'\]: expected uint8"):
        model.predict({**images, "observation.images.corner2": np.zeros((1, 32, 32, 3), np.float32)},
                      np.zeros((1, 4), np.float32), ["go"], noise)
    with pytest.raises(ValueError, match=r"noise: expected shape \[1, 6, 4\]"):
        model.predict(images, np.zeros((1, 4), np.float32), ["go"], np.zeros((1, 6, 3), np.float32))


def test_cameras_of_another_size_are_fitted_as_pytorch_fits_them() -> None:
    """The runtime's resize (numpy) against torch's antialiased bilinear, shrinking and enlarging, with padding."""
    from roboscale.deploy.runtime import fit_image
    from roboscale.utils.images import resize_with_pad

    rng = np.random.default_rng(0)
    for shape in ((48, 64), (20, 24), (32, 32), (90, 40)):
        image = rng.integers(0, 255, (*shape, 3), dtype=np.uint8)
        expected = resize_with_pad(torch.from_numpy(image).permute(2, 0, 1).float(), 32).permute(1, 2, 0)
        expected = expected.round().clamp(0, 255).to(torch.uint8).numpy()
        actual = fit_image(image, 32)
        assert actual.shape == (32, 32, 3)
        assert np.abs(actual.astype(int) - expected.astype(int)).max() <= 1


def test_groot_exports_with_pytorchs_actions(tmp_path: Path) -> None:
    """GR00T's VLM, VL self-attention and DiT in the padded layout: the export's own check (batch 1 and 8, guided)
    and the predictor against PolicyRunner on the rollout's items. (The unrolled graph is the policy's own modules
    in a generic loop, tested with pi0.5 above; benchmarks/export.py checks GR00T's too.)"""
    from roboscale.deploy.export import export_onnx
    from roboscale.rollout.onnx import OnnxPredictor

    path = tmp_path / "groot"
    _tiny_groot().save_pretrained(path)
    report = export_onnx(path, tmp_path / "onnx", unrolled=False)
    assert set(report.errors) == {"split1", "split8", "guided8"}
    assert max(report.errors.values()) < 1e-4
    items = _items(3)
    expected = np.stack([p.chunk for p in RunnerSettings(str(path), "cpu").build().predict(items)])
    actual = np.stack([p.chunk for p in OnnxPredictor(str(tmp_path / "onnx"), "cpu").predict(items)])
    assert _relative(actual, expected) < 1e-4


def _tiny_groot():
    from roboscale.models.registry import build_policy, preset_config
    from tests.models.helpers import fake_meta

    torch.manual_seed(0)
    return build_policy(preset_config("groot", "tiny", image_keys=["observation.images.corner2",
                                                                    "observation.images.wrist"]), fake_meta())


def test_the_runtime_imports_without_torch(tmp_path: Path) -> None:
    """roboscale.deploy.runtime on a machine without torch: only onnxruntime, numpy and tokenizers."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    out = subprocess.run([sys.executable, "-c", "import roboscale.deploy.runtime, roboscale.deploy.format"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(blocker)}, timeout=60)
    assert out.returncode == 0, out.stderr
