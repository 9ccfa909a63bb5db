import json

import pytest
import torch

from roboscale.errors import CheckpointError
from roboscale.models.policy import Policy
from tests.models.helpers import TASKS, batch, tiny_policy


def test_forward_backward_gives_finite_loss_and_gradients_everywhere():
    policy = tiny_policy()
    loss, metrics = policy(batch())
    loss.backward()
    assert torch.isfinite(loss) and metrics["loss"] > 0
    no_grad = [n for n, p in policy.named_parameters() if p.grad is None]
    assert no_grad == []  # no dead parameters (the last layer has no prefix MLP)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    policy = tiny_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    fixed = batch(b=8)
    torch.manual_seed(1)
    first = [policy(fixed)[0].item() for _ in range(5)]
    for _ in range(60):
        loss, _ = policy(fixed)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.manual_seed(1)
    last = [policy(fixed)[0].item() for _ in range(5)]
    assert sum(last) < 0.5 * sum(first)


def test_cached_prefix_inference_matches_recomputing_the_prefix():
    policy = tiny_policy().eval()
    obs = batch(b=2)
    packed = policy.as_packed_batch(obs)
    tokens, layout = policy.embed_prefix(packed)
    cache = policy._prefix_cache(tokens, layout)
    x = torch.randn(2, policy.config.chunk_size, 4)
    t = torch.full((2,), 0.7)
    for _ in range(3):  # Euler steps reuse the cache; it must not change underneath them
        cached = policy._velocity(x, t, cache, layout)
    fresh_cache = policy._prefix_cache(*policy.embed_prefix(packed))
    torch.testing.assert_close(cached, policy._velocity(x, t, fresh_cache, layout))


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
    torch.testing.assert_close(loaded.action_normalizer.a, policy.action_normalizer.a)


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
