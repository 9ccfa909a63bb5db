import json

import pytest
import torch

from roboscale.models.objective import flow_matching_loss

from roboscale.errors import CheckpointError
from roboscale.models.policy import Policy
from tests.models.helpers import TASKS, batch, tiny_policy


def test_forward_backward_gives_finite_loss_and_gradients_everywhere():
    policy = tiny_policy()
    loss, metrics = flow_matching_loss(policy, batch())
    loss.backward()
    assert torch.isfinite(loss) and metrics["loss"] > 0
    no_grad = [n for n, p in policy.named_parameters() if p.grad is None]
    assert no_grad == []  # no dead parameters (the last layer has no prefix MLP)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    policy = tiny_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    fixed = batch(b=8)
    torch.manual_seed(1)
    first = [flow_matching_loss(policy, fixed)[0].item() for _ in range(5)]
    for _ in range(60):
        loss, _ = flow_matching_loss(policy, fixed)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.manual_seed(1)
    last = [flow_matching_loss(policy, fixed)[0].item() for _ in range(5)]
    assert sum(last) < 0.5 * sum(first)


def test_the_cached_prefix_and_the_joint_layer_pass_predict_the_same_velocity():
    """Inference runs the prefix once and every Euler step against its cache; training runs each JointLayer's
    two passes together. Both compute the same velocity, and Euler steps never change the cache."""
    policy = tiny_policy().eval()
    obs = batch(b=2)
    cached = policy.encode(obs, cache=True)
    x = torch.randn(2, policy.config.chunk_size, 4)
    t = torch.full((2,), 0.7)
    for _ in range(3):
        from_cache = policy.velocity(cached, x, t)
    joint = policy.velocity(policy.encode(obs), x, t)
    torch.testing.assert_close(from_cache, joint, rtol=0, atol=0)


def test_a_joint_layer_is_one_unit_whose_forward_runs_both_towers():
    policy = tiny_policy()
    units = policy.parallel_units()
    assert units[-len(policy.layers):] == list(policy.layers)
    calls = []
    for layer in policy.layers:
        layer.register_forward_hook(lambda m, args, out: calls.append(m))
    flow_matching_loss(policy, batch())
    assert calls == list(policy.layers)  # once per layer per step: one all-gather serves both passes
    in_units = {id(p) for unit in units for p in unit.parameters()}
    outside = {n.split(".")[0] for n, p in policy.named_parameters() if id(p) not in in_units}
    assert outside <= {"vision", "projector", "embed_tokens", "state_proj", "action_in_proj", "time_mlp",
                       "expert_norm", "action_out_proj"}


def test_weights_initialised_apart_from_construction_on_the_meta_device():
    from roboscale.models.pi05.modeling import Pi05Policy
    from tests.models.helpers import fake_meta

    reference = tiny_policy()
    with torch.device("meta"):
        policy = Pi05Policy(reference.config, reference.tokenizer)
    assert all(p.is_meta for p in policy.parameters())
    policy.to_empty(device="cpu")
    torch.manual_seed(0)
    policy.init_weights()
    policy.set_normalization(fake_meta().stats)
    for name, p in policy.named_parameters():
        assert torch.isfinite(p).all(), name
        if name.endswith("modulation.weight") or ("norm" in name and name.endswith(".weight") and p.dim() == 1
                                                   and "vision" not in name):
            assert not p.any(), f"{name}: zero-initialised by construction, so by init_weights too"
    big = [n for n, p in reference.named_parameters() if p.dim() == 2 and p.numel() > 256 and p.detach().std() > 0]
    for name in big:  # the same scheme as construction: comparable spread
        a, b = dict(policy.named_parameters())[name], dict(reference.named_parameters())[name]
        assert 0.5 < float(a.detach().std() / b.detach().std()) < 2.0, name
    loss, _ = flow_matching_loss(policy, batch())
    assert torch.isfinite(loss)


def test_language_changes_the_prediction():
    policy = tiny_policy().eval()
    obs = batch(b=1, tasks=[TASKS[0]])
    other = dict(obs, task=[TASKS[1]])
    torch.manual_seed(0)
    a = policy.predict_action_chunk(obs)
    torch.manual_seed(0)
    b = policy.predict_action_chunk(other)
    assert a.shape == (1, policy.config.chunk_size, 4)
    assert not torch.allclose(a, b)


def test_save_then_load_gives_identical_actions(tmp_path):
    policy = tiny_policy().eval()
    policy.save_pretrained(tmp_path / "ckpt")
    loaded = Policy.from_pretrained(tmp_path / "ckpt").eval()
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["type"] == "pi05"
    obs = batch(b=2)
    torch.manual_seed(5)
    a = policy.predict_action_chunk(obs)
    torch.manual_seed(5)
    b = loaded.predict_action_chunk(obs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Normalization statistics travel with the weights.
    torch.testing.assert_close(loaded.action_normalizer.q01, policy.action_normalizer.q01)


def test_the_same_weights_are_saved_as_the_same_bytes(tmp_path):
    """Eval reports and the policy server identify weights by the file's sha256 (with a metadata map of two keys,
    safetensors' hash order made two saves differ in 1 of 2 tries)."""
    policy = tiny_policy()
    saved = {(policy.save_pretrained(tmp_path / str(i)) / "model.safetensors").read_bytes() for i in range(6)}
    assert len(saved) == 1


def test_checkpoint_of_another_policy_type_is_refused(tmp_path):
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["type"] = "octo"  # a policy type this roboscale does not know
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*unknown policy type 'octo'"):
        Policy.from_pretrained(tmp_path / "ckpt")


def test_checkpoint_whose_shapes_do_not_match_the_config_is_refused(tmp_path):
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["width"] = 64
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model.safetensors: weights do not match config.json.*shape mismatch"):
        Policy.from_pretrained(tmp_path / "ckpt")


def test_missing_or_corrupt_checkpoint_files_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        Policy.from_pretrained(tmp_path / "nope")
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        Policy.from_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: not a valid tokenizer.json"):
        Policy.from_pretrained(tmp_path / "ckpt")


def test_fp8_converts_the_large_layers_of_both_towers_and_leaves_the_ends_of_the_flow():
    from roboscale.models.pi05.modeling import Pi05Policy, fp8_filter
    from roboscale.models.registry import preset_config

    cfg = preset_config("pi05", "full", image_keys=["observation.images.base_0_rgb"], vocab_size=257152)
    with torch.device("meta"):
        policy = Pi05Policy(cfg)
    chosen = {name for name, module in policy.named_modules() if fp8_filter(name, module)}
    assert "layers.0.q_proj" in chosen and "layers.0.mlp.gate_proj" in chosen and "layers.0.expert_mlp.up_proj" in chosen
    assert "vision.blocks.0.fc1" in chosen
    for name in chosen:
        assert not name.startswith(("projector", "action_in_proj", "action_out_proj", "time_mlp", "state_proj"))
        assert not name.endswith("norm.modulation")
    linear = [m for m in policy.modules() if isinstance(m, torch.nn.Linear)]
    converted = sum(policy.get_submodule(n).weight.numel() for n in chosen)
    assert converted > 0.9 * sum(m.weight.numel() for m in linear)  # the FLOPs are in the chosen layers
