import json

import pytest
import torch

from roboscale.models.flow_matching import flow_matching_loss
from safetensors.torch import save_file

from roboscale.errors import CheckpointError
from roboscale.models.pi05.transform import state_prompt
from roboscale.models.pi05.lerobot import load_lerobot_pi05, to_lerobot
from roboscale.models.policy import Policy
from tests.models.helpers import batch, tiny_policy

LEROBOT_CONFIG = {"type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
                  "chunk_size": 6, "n_action_steps": 3, "max_state_dim": 4, "max_action_dim": 4}


def write_lerobot_checkpoint(policy, directory, extra=None):
    """What a LeRobot pi05 pretrained_model directory holds, with our tiny weights under LeRobot's names."""
    directory.mkdir(parents=True)
    state = to_lerobot(policy.state_dict(), policy.config)
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = torch.zeros(3, 3)  # dead in LeRobot too
    state.update(extra or {})
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(LEROBOT_CONFIG))
    policy.tokenizer.save(directory / "tokenizer.json")
    stats = {"observation.state.q01": policy.state_normalizer.q01, "observation.state.q99": policy.state_normalizer.q99,
             "action.q01": policy.action_normalizer.q01, "action.q99": policy.action_normalizer.q99}
    save_file(stats, str(directory / "policy_preprocessor_step_3_normalizer_processor.safetensors"))


def test_lerobot_names_are_written_for_every_tensor_family():
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    names = set(to_lerobot(policy.state_dict(), policy.config))
    vlm = "model.paligemma_with_expert.paligemma.model."
    expert = "model.paligemma_with_expert.gemma_expert.model."
    for name in [
        vlm + "vision_tower.vision_model.embeddings.patch_embedding.weight",
        vlm + "vision_tower.vision_model.embeddings.position_embedding.weight",
        vlm + "vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.bias",
        vlm + "vision_tower.vision_model.post_layernorm.weight",
        vlm + "multi_modal_projector.linear.weight",
        vlm + "language_model.embed_tokens.weight",
        vlm + "language_model.layers.0.mlp.gate_proj.weight",
        vlm + "language_model.layers.1.self_attn.k_proj.weight",
        expert + "layers.1.input_layernorm.dense.bias",
        expert + "norm.dense.weight",
        "model.time_mlp_in.weight",
        "model.action_in_proj.weight",
    ]:
        assert name in names, name
    # The last language-model layer only provides keys/values: LeRobot's q/o/MLP there feed nothing.
    assert vlm + "language_model.layers.1.self_attn.q_proj.weight" not in names


def test_a_lerobot_named_checkpoint_loads_and_predicts_identically(tmp_path):
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False).eval()
    write_lerobot_checkpoint(policy, tmp_path / "lerobot")
    loaded = load_lerobot_pi05(tmp_path / "lerobot", config=tiny_policy(state_input="prompt", vit_conv_stem=False).config).eval()
    obs = batch(b=2)
    torch.manual_seed(3)
    expected = policy.predict_action_chunk(obs)
    torch.manual_seed(3)
    torch.testing.assert_close(loaded.predict_action_chunk(obs), expected, rtol=0, atol=0)
    torch.testing.assert_close(loaded.action_normalizer.q99, policy.action_normalizer.q99)


def test_round_trip_to_lerobot_names_and_back_is_exact(tmp_path):
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    write_lerobot_checkpoint(policy, tmp_path / "lerobot")
    loaded = load_lerobot_pi05(tmp_path / "lerobot", config=tiny_policy(state_input="prompt", vit_conv_stem=False).config)
    for key, value in policy.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_from_pretrained_recognises_a_lerobot_checkpoint(tmp_path, monkeypatch):
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    write_lerobot_checkpoint(policy, tmp_path / "lerobot")
    calls = []
    monkeypatch.setattr("roboscale.models.pi05.lerobot.load_lerobot_pi05",
                        lambda directory, **kw: calls.append((directory, kw)) or "loaded")
    assert Policy.from_pretrained(tmp_path / "lerobot", tokenizer_path="/tok.json") == "loaded"
    assert calls == [(tmp_path / "lerobot", {"tokenizer_path": "/tok.json"})]


def test_foreign_tensors_and_a_missing_tokenizer_are_clear_errors(tmp_path):
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    write_lerobot_checkpoint(policy, tmp_path / "odd", extra={"model.some_new_head.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="not part of pi0.5 as we build it.*some_new_head"):
        load_lerobot_pi05(tmp_path / "odd", config=tiny_policy(state_input="prompt", vit_conv_stem=False).config)
    write_lerobot_checkpoint(policy, tmp_path / "notok")
    (tmp_path / "notok" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer_path"):
        load_lerobot_pi05(tmp_path / "notok", config=tiny_policy(state_input="prompt", vit_conv_stem=False).config)


def test_state_prompt_digitizes_like_pi05():
    prompt = state_prompt("Open a drawer", torch.tensor([-1.0, 0.0, 0.999, 2.0]))
    assert prompt == "Task: Open a drawer, State: 0 128 255 255;\nAction: "


def test_prompt_state_mode_has_no_state_projection_and_trains():
    policy = tiny_policy(state_input="prompt", vit_conv_stem=False)
    assert not hasattr(policy, "state_proj")
    loss, _ = flow_matching_loss(policy, batch())
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters())
