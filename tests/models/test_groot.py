import json

import pytest
import torch

from roboscale.config import ConfigError
from roboscale.errors import CheckpointError
from roboscale.models.groot import GrootConfig, GrootPolicy, layout_of
from roboscale.models.groot_vlm import VLLayout
from roboscale.models.policy import Policy
from roboscale.models.registry import GROOT_PRESETS, build_policy, preset_config
from tests.models.helpers import TASKS, batch, fake_meta

# Instructions of different token lengths, so a padded batch really has padding.
MIXED_TASKS = ["Go", "Rotate the faucet clockwise", "Open a drawer", "Press the button from the top near the wall"]


def tiny_groot(**overrides) -> GrootPolicy:
    torch.manual_seed(0)
    cfg = GrootConfig(**{**GROOT_PRESETS["tiny"], "num_inference_steps": 4, **overrides})
    meta = fake_meta()
    meta.task_list = TASKS + MIXED_TASKS
    return build_policy(cfg, meta)


def test_forward_gives_finite_loss_and_every_trainable_parameter_a_gradient():
    policy = tiny_groot()
    loss, metrics = policy(batch(b=4, tasks=MIXED_TASKS))
    loss.backward()
    assert torch.isfinite(loss) and metrics["loss"] > 0
    assert [n for n, p in policy.named_parameters() if p.grad is None] == []


def test_shapes_of_vl_tokens_and_action_chunks():
    policy = tiny_groot().eval()
    obs = batch(b=3, tasks=MIXED_TASKS[:3])
    layout = layout_of(policy, obs)
    _, lang_mask = policy.tokenizer.encode_batch(MIXED_TASKS[:3], policy.config.max_language_tokens)
    image_tokens = len(policy.config.image_keys) * policy.vlm.tokens_per_image  # 2 cameras x (32/8/2)^2 = 8
    expected = image_tokens + lang_mask.sum(1)
    assert torch.equal(layout.cu_seqlens[1:] - layout.cu_seqlens[:-1], expected.to(torch.int32))
    assert policy.predict_action_chunk(obs).shape == (3, policy.config.chunk_size, 4)


def test_padded_layout_puts_each_rows_tail_in_its_own_segment():
    layout = VLLayout.from_lengths(torch.tensor([3, 5, 2]), padded=True)
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 10, 12, 15]  # rows of 5: 3+2 pad, 5, 2+3 pad
    assert layout.is_sample.tolist() == [True, False, True, True, False]
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2]
    cu_q, _ = layout.query_cu_seqlens(4)
    assert cu_q.tolist() == [0, 4, 4, 8, 12, 12]  # padding segments get no queries
    packed = VLLayout.from_lengths(torch.tensor([3, 5, 2]))
    assert packed.cu_seqlens.tolist() == [0, 3, 8, 10] and packed.num_tokens == 10


def _loss_and_grads(policy, obs, seed=3):
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss, _ = policy(obs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_packed_and_padded_batches_give_the_same_loss_and_gradients():
    policy = tiny_groot()  # VLM trained (tiny preset), so gradients flow through every varlen attention
    obs = batch(b=4, tasks=MIXED_TASKS)
    policy.config.packed = False
    padded = layout_of(policy, obs)
    assert not bool(padded.is_sample.all())  # the padded stream really carries padding
    loss_pad, grads_pad = _loss_and_grads(policy, obs)
    policy.config.packed = True
    packed = layout_of(policy, obs)
    assert bool(packed.is_sample.all()) and packed.num_tokens < padded.num_tokens
    loss_packed, grads_packed = _loss_and_grads(policy, obs)
    torch.testing.assert_close(loss_packed, loss_pad, rtol=1e-6, atol=1e-6)
    assert grads_packed.keys() == grads_pad.keys() and len(grads_packed) == len(list(policy.parameters()))
    for name in grads_packed:
        torch.testing.assert_close(grads_packed[name], grads_pad[name], rtol=1e-5, atol=1e-6, msg=name)


def test_worker_side_tokenization_gives_the_batch_the_policy_would_make():
    import pickle

    policy = tiny_groot()
    obs = batch(b=4, tasks=MIXED_TASKS)
    transform, collate = pickle.loads(pickle.dumps(policy.data_transforms()))  # as the loader's workers get them
    samples = [{k: v[i] for k, v in obs.items()} for i in range(4)]
    collated = collate([transform(s) for s in samples])
    ids, mask = policy.tokenizer.encode_batch(MIXED_TASKS, policy.config.max_language_tokens)
    assert torch.equal(collated["observation.language.tokens"], ids)
    assert torch.equal(collated["observation.language.attention_mask"], mask) and not bool(mask.all())
    assert collated["task"] == MIXED_TASKS and torch.equal(collated["action"], obs["action"])
    loss_policy, grads_policy = _loss_and_grads(policy, obs)
    loss_worker, grads_worker = _loss_and_grads(policy, collated)
    torch.testing.assert_close(loss_worker, loss_policy, rtol=0, atol=0)
    for name in grads_policy:
        torch.testing.assert_close(grads_worker[name], grads_policy[name], rtol=0, atol=0, msg=name)


def test_attention_backend_reaches_every_attention_over_vl_tokens(monkeypatch):
    from roboscale.models import attention

    obs = batch(b=4, tasks=MIXED_TASKS)
    reference, _ = _loss_and_grads(tiny_groot(attention_backend="dense"), obs)
    calls = []
    real_mask = attention.segment_mask
    monkeypatch.setattr(attention, "segment_mask", lambda *a, **kw: calls.append(1) or real_mask(*a, **kw))
    segmented, _ = _loss_and_grads(tiny_groot(attention_backend="sdpa"), obs)
    assert calls == []  # per-segment SDPA builds no [L, L] mask anywhere
    torch.testing.assert_close(segmented, reference, rtol=1e-5, atol=1e-6)
    _loss_and_grads(tiny_groot(attention_backend="dense"), obs)
    cfg = tiny_groot().config
    assert len(calls) == cfg.llm_layers + cfg.vl_layers + (cfg.dit_layers + 1) // 2  # LLM, VL self-attn, DiT cross
    with pytest.raises(ConfigError, match="attention_backend.*not one of"):
        GrootConfig(attention_backend="fast")


def test_a_sample_does_not_see_its_batch_mates():
    policy = tiny_groot().eval()
    obs = batch(b=4, tasks=MIXED_TASKS)
    x = torch.randn(4, policy.config.chunk_size, 4)
    t = torch.tensor([0, 250, 500, 750])
    with torch.no_grad():
        together = policy.action_head.velocity(x, t, *_reorder(policy.encode_observation(obs)))
        alone = {k: v[1:2] for k, v in obs.items()}
        single = policy.action_head.velocity(x[1:2], t[1:2], *_reorder(policy.encode_observation(alone)))
    torch.testing.assert_close(single[0], together[1], rtol=1e-5, atol=1e-5)


def _reorder(encoded):
    context, layout, state_features, embodiment = encoded
    return state_features, context, layout, embodiment


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    policy = tiny_groot()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    fixed = batch(b=4)
    torch.manual_seed(1)
    first = [policy(fixed)[0].item() for _ in range(5)]
    for _ in range(60):
        loss, _ = policy(fixed)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.manual_seed(1)
    last = [policy(fixed)[0].item() for _ in range(5)]
    assert sum(last) < 0.7 * sum(first)  # 0.55 measured; with GR00T's fixed 0.02 init it stayed at 1.0


def test_frozen_vlm_gets_no_gradients_and_the_action_head_does():
    policy = tiny_groot(tune_llm=False, tune_visual=False)
    loss, _ = policy(batch(b=2))
    loss.backward()
    vlm = [(n, p) for n, p in policy.named_parameters() if n.startswith("vlm.")]
    head = [(n, p) for n, p in policy.named_parameters() if n.startswith("action_head.")]
    assert vlm and all(not p.requires_grad and p.grad is None for _, p in vlm)
    assert head and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in head)
    # Only the language model frozen: the ViT and projector still learn.
    policy = tiny_groot(tune_llm=False, tune_visual=True)
    policy(batch(b=2))[0].backward()
    assert policy.vlm.vision.pos_embed.grad is not None and policy.vlm.layers[0].q_proj.weight.grad is None


def test_language_and_embodiment_change_the_prediction():
    policy = tiny_groot().eval()
    obs = batch(b=1, tasks=[TASKS[0]])

    def predict(o):
        torch.manual_seed(0)
        return policy.predict_action_chunk(o)

    base = predict(obs)
    assert not torch.allclose(base, predict(dict(obs, task=[TASKS[1]])))
    assert not torch.allclose(base, predict(dict(obs, embodiment_id=torch.tensor([1]))))
    with pytest.raises(ValueError, match="embodiment_id .* outside"):
        predict(dict(obs, embodiment_id=torch.tensor([2])))


def test_save_then_load_gives_identical_actions(tmp_path):
    policy = tiny_groot().eval()
    policy.save_pretrained(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["type"] == "groot"
    loaded = Policy.from_pretrained(tmp_path / "ckpt").eval()
    assert isinstance(loaded, GrootPolicy)
    obs = batch(b=2, tasks=MIXED_TASKS[:2])
    torch.manual_seed(5)
    a = policy.predict_action_chunk(obs)
    torch.manual_seed(5)
    b = loaded.predict_action_chunk(obs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(loaded.action_normalizer.b, policy.action_normalizer.b)


def test_checkpoint_whose_shapes_do_not_match_the_config_names_the_fields_to_restore(tmp_path):
    policy = tiny_groot()
    policy.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["dit_width"] = 64
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*shape mismatch.*fields of config.json that set "
                                              r"those shapes are .*'dit_width'.*restore the values") as info:
        Policy.from_pretrained(tmp_path / "ckpt")
    assert "llm_layers" not in str(info.value)  # only fields of the mismatched parts


def test_a_config_size_the_dataset_does_not_have_is_named_with_the_fix():
    with pytest.raises(ConfigError, match=r"policy.action_dim is 32 but 'action' of the dataset at <memory> has 4 "
                                          r"values; set --policy.action_dim=4"):
        build_policy(GrootConfig(**{**GROOT_PRESETS["tiny"], "action_dim": 32}), fake_meta())
    assert build_policy(GrootConfig(**{**GROOT_PRESETS["tiny"], "state_dim": 4}), fake_meta()).config.state_dim == 4


def test_config_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="chunk_size 32 exceeds policy.max_seq_len 16"):
        GrootConfig(chunk_size=32)
    with pytest.raises(ConfigError, match="embodiment_id 3 is not a slot"):
        GrootConfig(num_embodiments=2, embodiment_id=3)


def test_full_size_builds_on_the_meta_device_at_gr00t_n15_size():
    cfg = preset_config("groot", "full", image_keys=["observation.images.ego_view"], vocab_size=151680)
    with torch.device("meta"):
        policy = GrootPolicy(cfg)
    total = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    # 2.40 B built (no lm_head); + the tied 311 M lm_head = 2.71 B, the design's ~2.7 B.
    assert 2.35e9 < total < 2.45e9
    assert 2.65e9 < total + cfg.vocab_size * cfg.llm_width < 2.75e9
    assert 1.0e9 < trainable < 1.1e9  # frozen VLM: the action head trains
    assert len(policy.action_head.dit.blocks) == 16 and len(policy.vlm.layers) == 12
