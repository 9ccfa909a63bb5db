"""What our tests need to run LeRobot's own pi0.5 (``lerobot_pi05.py``) as an oracle: its venv, the sizes both
sides build, and the fixture it wrote (``tests/fixtures/lerobot-pi05-tiny``)."""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch

HERE = Path(__file__).resolve().parent
ORACLE = HERE / "lerobot_pi05.py"
FIXTURE = HERE.parent / "fixtures" / "lerobot-pi05-tiny"
SIZES = json.loads((HERE / "lerobot_pi05_sizes.json").read_text())
LEROBOT_PYTHON = Path(os.environ.get("ROBOSCALE_LEROBOT_PYTHON", HERE.parents[1] / ".venv-lerobot" / "bin" / "python"))
ORACLE_TIMEOUT_S = 600  # building and running a tiny model takes ~10 s; the venv's first imports more


def size_tables(size: str = "tiny") -> dict[str, object]:
    """Our LeRobot adapter's tables (``"module.NAME"`` -> value) that read LeRobot's variant names as ``size``
    builds them on LeRobot's side: configuration values only, as the oracle changes on its side."""
    spec, tables = SIZES[size], {}
    if spec["gemma"]:
        fields = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
        tables["roboscale.models.pi05.lerobot.GEMMA_VARIANTS"] = {
            name: tuple(dims[f] for f in fields) for name, dims in spec["gemma"].items()}
    if spec["vision"]:
        v = spec["vision"]
        tables["roboscale.models.pi05.lerobot.SIGLIP"] = {
            "vit_patch_size": v["patch_size"], "vit_dim": v["hidden_size"], "vit_depth": v["num_hidden_layers"],
            "vit_heads": v["num_attention_heads"], "vit_mlp_dim": v["intermediate_size"], "vit_norm_eps": 1e-6}
    return tables


def use_sizes(monkeypatch: pytest.MonkeyPatch, size: str = "tiny") -> None:
    for target, value in size_tables(size).items():
        monkeypatch.setattr(target, value)


def lerobot_python() -> Path:
    """The LeRobot venv's python, or a skip saying why there is none (tests/oracles/README.md builds it)."""
    if not LEROBOT_PYTHON.is_file():
        pytest.skip(f"LeRobot's venv is not at {LEROBOT_PYTHON} (tests/oracles/README.md builds it; "
                    "ROBOSCALE_LEROBOT_PYTHON points elsewhere)")
    probe = subprocess.run([str(LEROBOT_PYTHON), "-c", "from transformers.models.siglip import check; "
                            "import lerobot.policies.pi05.modeling_pi05; "
                            "assert check.check_whether_transformers_replace_is_installed_correctly()"],
                           capture_output=True, text=True, timeout=ORACLE_TIMEOUT_S)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"LeRobot's venv at {LEROBOT_PYTHON} cannot build PI05Policy ({last}): see tests/oracles/README.md")
    return LEROBOT_PYTHON


def run_oracle(python: Path, *args: str) -> None:
    run_script(python, ORACLE, *args)


def run_script(python: Path, script: Path, *args: str) -> None:
    """One of the oracle scripts here, in LeRobot's venv (offline, one thread)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(python), str(script), *args], capture_output=True, text=True, env=env,
                          timeout=ORACLE_TIMEOUT_S)
    if done.returncode:
        raise AssertionError(f"LeRobot's {script.name} failed ({' '.join(args)}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / theirs.double().norm())


def read_oracle(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(str(directory / "oracle.safetensors")), json.loads((directory / "oracle.json").read_text())


def observation(record: dict[str, torch.Tensor], meta: dict, cameras: list[str] | None = None,
                actions: bool = False) -> dict:
    """The observation LeRobot was given (uint8 frames here: ours converts them as LeRobot's float [0, 1] ones)."""
    obs = {k: record[f"input.{k}"] for k in (meta["cameras"] if cameras is None else cameras)}
    obs["observation.state"] = record["input.observation.state"]
    obs["task"] = list(meta["tasks"])
    if actions:
        obs["action"] = record["input.action"]
    return obs


def load_oracle_policy(directory: Path):
    from roboscale.models.policy import Policy

    return Policy.from_pretrained(directory / "pretrained_model", tokenizer_path=directory / "tokenizer.json").eval()


@torch.no_grad()
def agreement(directory: Path, policy=None) -> dict[str, float]:
    """What ours computes for LeRobot's model in ``directory`` against what LeRobot computed (``build``): relative
    errors of the action chunk (all cameras; one camera slot left out), the loss and its elements (LeRobot's noise
    and time), the largest difference of the normalized state, and 1.0 / 0.0 for prompts and token ids equal."""
    from roboscale.models.flow_matching import FlowMatching
    from roboscale.models.objective import flow_matching_loss
    from roboscale.models.pi05.transform import state_prompt

    record, meta = read_oracle(directory)
    policy = policy or load_oracle_policy(directory)
    out: dict[str, float] = {}
    obs = observation(record, meta)
    state = policy.state_normalizer.normalize(obs["observation.state"])
    width = record["lerobot.state_normalized"].shape[1]
    out["state_max_abs"] = float((state[:, :width] - record["lerobot.state_normalized"]).abs().max())
    prompts = [state_prompt(task, state[i]) for i, task in enumerate(meta["tasks"])]
    out["prompts_equal"] = float(prompts == meta["prompts"])
    transform, _ = policy.data_transforms()
    out["tokens_equal"] = float(all(
        sample.tokens.tolist() == record["lerobot.tokens"][i][record["lerobot.token_mask"][i]].tolist()
        for i, sample in enumerate(transform.from_batch(obs))))
    out["actions"] = relative_error(policy.predict_action_chunk(obs, noise=record["input.noise"]),
                                    record["lerobot.actions"])
    one_camera = observation(record, meta, cameras=meta["cameras"][:1])
    out["actions_one_camera"] = relative_error(policy.predict_action_chunk(one_camera, noise=record["input.noise"]),
                                               record["lerobot.actions_one_camera"])
    draws = (record["input.loss_noise"], record["input.loss_time"])
    batch = {**observation(record, meta, actions=True), "sample_seed": torch.arange(len(meta["tasks"]))}
    mask = policy.config.action_loss_mask
    policy.config.action_loss_mask = False  # no padded steps here; LeRobot's pi0.5 would count them
    try:
        with mock.patch.object(FlowMatching, "draws_per_sample", lambda self, seeds, shape, device: draws):
            loss, _ = flow_matching_loss(policy, batch)
        encoded = policy.encode(batch)
    finally:
        policy.config.action_loss_mask = mask
    out["loss"] = relative_error(loss, record["lerobot.loss"][0])
    out["loss_ours"], out["loss_lerobot"] = float(loss), float(record["lerobot.loss"][0])
    x_t, target = policy.flow_matching.interpolate(encoded.actions, *draws)
    dims = record["lerobot.loss_per_element"].shape[-1]
    per_element = (policy.velocity(encoded, x_t, draws[1]) - target)[..., :dims].pow(2)
    out["loss_per_element"] = relative_error(per_element, record["lerobot.loss_per_element"])
    return out


def randomized_copy(policy, seed: int):
    """A policy of ours with the same architecture and statistics, every weight drawn afresh (scaled by fan-in)."""
    from roboscale.models.pi05.modeling import Pi05Policy

    ours = Pi05Policy(copy.deepcopy(policy.config), policy.tokenizer)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (p[0].numel() ** -0.5 if p.dim() >= 2 else 0.1))
    for name in ("state_normalizer", "action_normalizer"):
        getattr(ours, name).load_state_dict(getattr(policy, name).state_dict())
    return ours.eval()


def reverse_agreement(python: Path, ours, directory: Path, work: Path, size: str = "tiny") -> dict[str, float]:
    """``ours`` saved in LeRobot's format, loaded by LeRobot's ``from_pretrained`` and processors, run on the
    inputs of the oracle in ``directory``: the relative errors of LeRobot's chunks against ours."""
    from safetensors.torch import load_file, save_file

    from roboscale.models.pi05.lerobot import save_lerobot_pi05

    record, meta = read_oracle(directory)
    with torch.no_grad():
        mine = ours.predict_action_chunk(observation(record, meta), noise=record["input.noise"])
        mine_one = ours.predict_action_chunk(observation(record, meta, cameras=meta["cameras"][:1]),
                                             noise=record["input.noise"])
    save_lerobot_pi05(ours, work / "ours")
    del ours  # the caller's reference may be the last: a full-size model is not held while LeRobot runs
    gc.collect()
    shutil.copy(directory / "tokenizer.json", work / "tokenizer.json")
    save_file({k: v for k, v in record.items() if k.startswith("input.")}, str(work / "inputs.safetensors"))
    run_oracle(python, "predict", str(work / "ours"), str(work / "inputs.safetensors"),
               str(work / "lerobot.safetensors"), f"--size={size}")
    theirs = load_file(str(work / "lerobot.safetensors"))
    return {"actions": relative_error(mine, theirs["lerobot.actions"]),
            "actions_one_camera": relative_error(mine_one, theirs["lerobot.actions_one_camera"])}
