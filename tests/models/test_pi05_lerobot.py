"""LeRobot's pi0.5 checkpoints, checked against LeRobot's own code (``tests/oracles/README.md``).

From the fixture LeRobot 0.4.4 wrote (``tests/fixtures/lerobot-pi05-tiny``: its ``PI05Policy``, randomly initialised
and saved with its ``save_pretrained``, with the inputs it was given and what it computed): we load it and compute
LeRobot's normalized state, prompts, token ids, action chunk and loss; fine-tuning from it trains; what we write in
LeRobot's format has exactly the tensors and files LeRobot writes. Where LeRobot's venv is built, the same against a
model LeRobot builds in the test, and the reverse direction (LeRobot loads ours and computes our actions).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.objective import flow_matching_loss
from roboscale.models.pi05.lerobot import (
    from_lerobot,
    load_lerobot_pi05,
    save_lerobot_pi05,
    to_lerobot,
    unused_tensors,
)
from roboscale.models.pi05.transform import state_prompt
from roboscale.models.policy import Policy
from tests.models.helpers import batch, tiny_policy
from tests.oracles.lerobot_oracle import (
    FIXTURE,
    agreement,
    lerobot_python,
    load_oracle_policy,
    randomized_copy,
    reverse_agreement,
    run_oracle,
    use_sizes,
)

RTOL = 1e-4  # relative agreement asked of every computed tensor (float32 on both sides: ~1e-5 is measured)


def check_against_lerobot(directory: Path) -> None:
    """Everything LeRobot computed for its model in ``directory``, computed by ours."""
    policy = load_oracle_policy(directory)
    cfg = policy.config
    assert (cfg.state_dim, cfg.dataset_state_dim, cfg.action_dim, cfg.dataset_action_dim) == (32, 8, 32, 7)
    result = agreement(directory, policy)
    assert result["state_max_abs"] < 1e-6
    # the state zero-padded before it is digitized, bin -1 below the range, LeRobot's task cleaning, <bos>, truncation
    assert result["prompts_equal"] == 1.0 and result["tokens_equal"] == 1.0
    for name in ("actions", "actions_one_camera", "loss", "loss_per_element"):
        assert result[name] < RTOL, (name, result[name])


# --- the fixture LeRobot wrote ------------------------------------------------------------------------------------
def test_a_lerobot_checkpoint_loads_and_computes_lerobots_actions_and_loss(monkeypatch):
    use_sizes(monkeypatch)
    check_against_lerobot(FIXTURE)


def test_the_tied_embedding_is_read_from_lm_head_and_the_gate_bias_shifts_by_one(monkeypatch):
    use_sizes(monkeypatch)
    weights = load_file(str(FIXTURE / "pretrained_model" / "model.safetensors"))
    assert "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight" not in weights
    policy = load_oracle_policy(FIXTURE)
    lm_head = weights["model.paligemma_with_expert.paligemma.lm_head.weight"]
    torch.testing.assert_close(policy.embed_tokens.weight, lm_head)
    theirs = weights["model.paligemma_with_expert.gemma_expert.model.norm.dense.bias"]
    ours = policy.expert_norm.modulation.bias.detach()
    third = theirs.shape[0] // 3
    torch.testing.assert_close(ours[: 2 * third], theirs[: 2 * third])
    torch.testing.assert_close(1.0 + ours[2 * third :], theirs[2 * third :])  # x + (1 + g) y  ==  x + g' y


def test_fine_tuning_from_a_lerobot_checkpoint_takes_steps_on_a_dataset_of_another_width(
        tiny_dataset, tmp_path, monkeypatch):
    """`roboscale train --policy.pretrained_path` on a 4-d state / 4-d action dataset with other camera names."""
    from roboscale.cli import main

    use_sizes(monkeypatch)
    out = tmp_path / "tuned"
    assert main(["train", f"--dataset.root={tiny_dataset}", f"--policy.pretrained_path={FIXTURE / 'pretrained_model'}",
                 f"--policy.tokenizer_path={FIXTURE / 'tokenizer.json'}", "--steps=3", "--batch_size=4",
                 "--log_freq=1", "--save_freq=3", f"--output_dir={out}"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    tuned = Policy.from_pretrained(out / "checkpoints" / "last" / "pretrained_model")
    cfg = tuned.config
    assert (cfg.dataset_state_dim, cfg.dataset_action_dim, cfg.loss_action_dims) == (4, 4, "dataset")
    assert cfg.prompt_state_padded and cfg.missing_cameras == "empty" and cfg.vit_norm_eps == 1e-6
    start = load_oracle_policy(FIXTURE)
    moved = [n for n, p in tuned.named_parameters() if not torch.equal(p, start.state_dict()[n])]
    assert moved, "the training steps changed no weight"
    # and back to LeRobot's format: the same policy, read back through the LeRobot adapter
    exported = tmp_path / "lerobot"
    assert main(["export", str(out), f"--output={exported}", "--format=lerobot"]) == 0
    assert main(["export", str(out), f"--output={tmp_path / 'x'}", "--format=tensorrt"]) == 2
    again = Policy.from_pretrained(exported).eval()
    obs = {k: v for k, v in batch(b=2).items() if not k.startswith("action")}
    noise = torch.randn(2, cfg.chunk_size, cfg.action_dim)
    torch.testing.assert_close(again.predict_action_chunk(obs, noise=noise), tuned.eval().predict_action_chunk(
        obs, noise=noise), rtol=1e-5, atol=1e-6)


def test_what_we_write_in_lerobots_format_has_the_tensors_and_files_lerobot_writes(monkeypatch, tmp_path):
    use_sizes(monkeypatch)
    policy = load_oracle_policy(FIXTURE)
    save_lerobot_pi05(policy, tmp_path / "ours")
    theirs_dir = FIXTURE / "pretrained_model"

    def header(path: Path) -> dict:
        with path.open("rb") as f:
            return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))

    ours, theirs = header(tmp_path / "ours" / "model.safetensors"), header(theirs_dir / "model.safetensors")
    assert ours.pop("__metadata__") == theirs.pop("__metadata__")  # the tie, recorded as LeRobot records it
    assert {k: (v["dtype"], v["shape"]) for k, v in ours.items()} == {k: (v["dtype"], v["shape"])
                                                                       for k, v in theirs.items()}
    live = set(theirs) - set(unused_tensors(policy.config))  # LeRobot's tensors that feed nothing we write as 0
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    original = load_file(str(theirs_dir / "model.safetensors"))
    for key in live:  # what computes is LeRobot's tensor back, bit for bit (gate biases shifted there and back)
        torch.testing.assert_close(saved[key], original[key], rtol=0, atol=1e-6, msg=key)
    for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
        assert json.loads((tmp_path / "ours" / name).read_text()) == json.loads((theirs_dir / name).read_text())
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    lerobot_config = json.loads((theirs_dir / "config.json").read_text())
    assert {k: v for k, v in lerobot_config.items() if k in config} == config
    stats = load_file(str(tmp_path / "ours" / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    original_stats = load_file(str(theirs_dir / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    for key, value in stats.items():
        torch.testing.assert_close(value, original_stats[key], rtol=0, atol=0, msg=key)
    # and it loads back here as the same policy
    again = Policy.from_pretrained(tmp_path / "ours")
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=1e-6, msg=key)


def test_policies_lerobot_cannot_compute_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot compute this policy.*policy.state_input is 'token'.*Gemma"):
        save_lerobot_pi05(tiny_policy(), tmp_path / "x")


# --- the live oracle ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lerobot():
    return lerobot_python()


def test_a_model_lerobot_builds_now_loads_and_computes_its_actions(lerobot, tmp_path, monkeypatch):
    run_oracle(lerobot, "build", str(tmp_path / "lerobot"), "--seed=3")
    use_sizes(monkeypatch)
    check_against_lerobot(tmp_path / "lerobot")


def test_our_pi05_saved_in_lerobots_format_computes_our_actions_in_lerobot(lerobot, tmp_path, monkeypatch):
    use_sizes(monkeypatch)
    torch.manual_seed(11)
    ours = randomized_copy(load_oracle_policy(FIXTURE), seed=12)  # our init, then every weight random
    result = reverse_agreement(lerobot, ours, FIXTURE, tmp_path)
    assert result["actions"] < RTOL and result["actions_one_camera"] < RTOL, result


# --- conversion details without LeRobot --------------------------------------------------------------------------
def test_conversion_to_lerobot_names_and_back_is_exact():
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    back = from_lerobot(to_lerobot(policy.state_dict(), policy.config), policy.config, Path("x"))
    own = {k: v for k, v in policy.state_dict().items() if not k.startswith(("state_normalizer", "action_normalizer"))}
    assert set(back) == set(own)
    for key, value in own.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_files_in_openpis_pytorch_naming_load_as_lerobot_loads_them(tmp_path, monkeypatch):
    """LeRobot's key fixes (``_fix_pytorch_state_dict_keys``): no ``model.`` prefix, ``action_time_mlp_*``, a pi0
    ``state_proj`` and the expert's plain RMSNorm weights, which the adaRMSNorm replaces, are skipped."""
    use_sizes(monkeypatch)
    shutil.copytree(FIXTURE / "pretrained_model", tmp_path / "openpi")
    weights = load_file(str(tmp_path / "openpi" / "model.safetensors"))
    renamed = {k.removeprefix("model.").replace("time_mlp_", "action_time_mlp_"): v for k, v in weights.items()}
    renamed["state_proj.weight"] = torch.zeros(16, 32)
    renamed["paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight"] = torch.zeros(16)
    save_file(renamed, str(tmp_path / "openpi" / "model.safetensors"))
    loaded = load_lerobot_pi05(tmp_path / "openpi", tokenizer_path=FIXTURE / "tokenizer.json")
    for key, value in load_oracle_policy(FIXTURE).state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_foreign_tensors_and_a_missing_tokenizer_are_clear_errors(tmp_path, monkeypatch):
    use_sizes(monkeypatch)
    shutil.copytree(FIXTURE / "pretrained_model", tmp_path / "odd")
    weights = load_file(str(tmp_path / "odd" / "model.safetensors"))
    save_file({**weights, "model.some_new_head.weight": torch.zeros(2)}, str(tmp_path / "odd" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not part of pi0.5 as we build it.*some_new_head"):
        load_lerobot_pi05(tmp_path / "odd", tokenizer_path=FIXTURE / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer_path"):
        load_lerobot_pi05(FIXTURE / "pretrained_model")


def test_state_prompt_digitizes_like_pi05():
    # stripped, underscores and inner newlines made spaces, runs of spaces kept; no clamp below -1
    prompt = state_prompt(" Open_a\n  drawer\n", torch.tensor([-1.5, -1.0, 0.0, 0.999, 2.0]))
    assert prompt == "Task: Open a   drawer, State: -1 0 128 255 255;\nAction: "


def test_prompt_state_mode_has_no_state_projection_and_trains():
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    assert not hasattr(policy, "state_proj")
    loss, _ = flow_matching_loss(policy, batch())
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())
