import json

import pytest
import torch

from roboscale.config import ConfigError
from roboscale.errors import CheckpointError
from roboscale.models.objective import flow_matching_loss
from roboscale.models.groot.config import GrootConfig
from roboscale.models.groot.modeling import GrootPolicy, layout_of
from roboscale.models.groot.vlm import VLLayout
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


def test_loss_is_finite_and_gives_every_trainable_parameter_a_gradient():
    policy = tiny_groot()
    loss, metrics = flow_matching_loss(policy, batch(b=4, tasks=MIXED_TASKS))
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
    loss, _ = flow_matching_loss(policy, obs)
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
        tiny_groot(attention_backend="fast")


def test_a_sample_does_not_see_its_batch_mates():
    policy = tiny_groot().eval()
    obs = batch(b=4, tasks=MIXED_TASKS)
    x = torch.randn(4, policy.config.chunk_size, 4)
    t = torch.tensor([0.0, 0.25, 0.5, 0.75])
    with torch.no_grad():
        together = policy.velocity(policy.encode(obs), x, t)
        alone = {k: v[1:2] for k, v in obs.items()}
        single = policy.velocity(policy.encode(alone), x[1:2], t[1:2])
    torch.testing.assert_close(single[0], together[1], rtol=1e-5, atol=1e-5)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    policy = tiny_groot()
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    fixed = batch(b=4)
    torch.manual_seed(1)
    first = [flow_matching_loss(policy, fixed)[0].item() for _ in range(5)]
    for _ in range(60):
        loss, _ = flow_matching_loss(policy, fixed)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.manual_seed(1)
    last = [flow_matching_loss(policy, fixed)[0].item() for _ in range(5)]
    assert sum(last) < 0.7 * sum(first)  # 0.55 measured; with GR00T's fixed 0.02 init it stayed at 1.0


def test_frozen_vlm_gets_no_gradients_and_the_action_head_does():
    policy = tiny_groot(tune_llm=False, tune_visual=False)
    loss, _ = flow_matching_loss(policy, batch(b=2))
    loss.backward()
    vlm = [(n, p) for n, p in policy.named_parameters() if n.startswith("vlm.")]
    head = [(n, p) for n, p in policy.named_parameters() if n.startswith("action_head.")]
    assert vlm and all(not p.requires_grad and p.grad is None for _, p in vlm)
    assert head and all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in head)
    # Only the language model frozen: the ViT and projector still learn.
    policy = tiny_groot(tune_llm=False, tune_visual=True)
    flow_matching_loss(policy, batch(b=2))[0].backward()
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
    for key, value in policy.action_normalizer.stats().items():
        torch.testing.assert_close(loaded.action_normalizer.stats()[key], value, rtol=0, atol=0)


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


def _full_size_config() -> GrootConfig:
    """The full preset with the dataset-filled fields set as ``roboscale model info`` sets them."""
    cfg = preset_config("groot", "full")
    cfg.image_keys = cfg.image_keys or ["observation.images.corner2", "observation.images.wrist"]
    cfg.state_dim = cfg.state_dim or 4
    cfg.action_dim = cfg.action_dim or 4
    cfg.vocab_size = cfg.vocab_size or 512
    return cfg


def test_a_policy_built_on_the_meta_device_is_initialised_by_init_weights_as_construction_does():
    built = tiny_groot()
    with torch.device("meta"):
        policy = GrootPolicy(built.config, built.tokenizer)
    assert all(p.is_meta for p in policy.parameters())
    policy.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*policy.parameters(), *policy.buffers()]:
            tensor.fill_(float("nan"))  # a tensor init_weights misses stays NaN
    torch.manual_seed(1)
    policy.init_weights()
    reference = {name: param.detach() for name, param in built.named_parameters()}
    for name, param in ((name, param.detach()) for name, param in policy.named_parameters()):
        assert bool(torch.isfinite(param).all()), f"{name} was not initialised"
        ref = reference[name]
        if bool((ref == ref.flatten()[0]).all()):  # constant rules: zero biases, LayerNorm ones, RMSNorm offsets 0
            assert torch.equal(param, ref), name
        else:
            assert not bool((param == param.flatten()[0]).all()), name
            if ref.numel() >= 256:  # the same distribution: its spread within sampling noise
                assert 0.8 < float(param.std() / ref.std()) < 1.25, name
    blocks = policy.action_head.dit.blocks
    for i in range(len(blocks)):
        for j in range(i + 1, len(blocks)):
            assert not torch.equal(blocks[i].attn.to_q.weight, blocks[j].attn.to_q.weight), (i, j)
            assert not torch.equal(blocks[i].norm1.linear.weight, blocks[j].norm1.linear.weight), (i, j)
    assert all(bool(torch.isfinite(b).all()) for b in policy.buffers())  # normalizers: the identity's statistics
    policy.set_normalization(fake_meta().stats)
    loss, _ = flow_matching_loss(policy, batch(b=2, tasks=MIXED_TASKS[:2]))
    assert torch.isfinite(loss)


# Parameters outside every unit, as GrootPolicy.parallel_units documents them.
OUTSIDE_UNITS = ("vlm.vision.patch_embed", "vlm.vision.pos_embed", "vlm.vision.norm", "vlm.projector",
                 "vlm.embed_tokens", "vlm.norm", "action_head.vlln", "action_head.state_encoder",
                 "action_head.action_encoder", "action_head.action_decoder", "action_head.future_tokens",
                 "action_head.position_embedding", "action_head.dit.timestep_encoder", "action_head.dit.proj_out_1",
                 "action_head.dit.proj_out_2")


def test_parallel_units_hold_every_parameter_but_the_documented_top_level_ones():
    policy = tiny_groot()
    cfg = policy.config
    units = policy.parallel_units()
    assert len(units) == cfg.vit_depth + cfg.llm_layers + cfg.vl_layers + cfg.dit_layers
    owner: dict[int, int] = {}
    for i, unit in enumerate(units):
        for param in unit.parameters():
            assert id(param) not in owner, f"a parameter of unit {i} is also in unit {owner[id(param)]}"
            owner[id(param)] = i
    outside = [name for name, param in policy.named_parameters() if id(param) not in owner]
    assert [name for name in outside if not name.startswith(OUTSIDE_UNITS)] == []
    assert [p for p in OUTSIDE_UNITS if not any(name.startswith(p) for name in outside)] == []  # the list is current
    order = [type(unit).__name__ for unit in units]
    assert order == (["ViTBlock"] * cfg.vit_depth + ["Qwen3Layer"] * cfg.llm_layers
                     + ["VLSelfAttentionBlock"] * cfg.vl_layers + ["DiTBlock"] * cfg.dit_layers)


def test_a_dit_block_reads_the_vl_features_in_its_own_forward():
    """A cross-attending block's keys/values are projected inside its forward: a hook on the block sees every
    weight of the block used, and the old checkpoint names (``...attn.to_k``) still hold them."""
    policy = tiny_groot()
    block = policy.action_head.dit.blocks[0]
    assert block.cross and {"attn.to_k.weight", "attn.to_v.weight"} <= dict(block.named_parameters()).keys()
    inside = []
    hooks = [block.register_forward_pre_hook(lambda *_: inside.append(True)),
             block.register_forward_hook(lambda *_: inside.append(False))]
    seen = []
    hooks.append(block.attn.to_k.register_forward_hook(lambda *_: seen.append(bool(inside and inside[-1]))))
    flow_matching_loss(policy, batch(b=2))
    for hook in hooks:
        hook.remove()
    assert seen == [True]


def test_fp8_filter_takes_the_large_linear_layers_of_the_blocks_only():
    from roboscale.models.groot.head import CategorySpecificLinear
    from roboscale.models.groot.modeling import fp8_filter

    with torch.device("meta"):
        policy = GrootPolicy(_full_size_config())
    modules = dict(policy.named_modules())
    chosen = [name for name, module in modules.items() if fp8_filter(name, module)]
    for name in chosen:
        module = modules[name]
        assert isinstance(module, torch.nn.Linear), name
        out_features, in_features = module.weight.shape
        assert out_features % 16 == 0 and in_features % 16 == 0 and min(out_features, in_features) >= 1024, name
    ends = ("vlm.vision.patch_embed", "vlm.projector", "action_head.state_encoder", "action_head.action_encoder",
            "action_head.action_decoder", "action_head.dit.timestep_encoder", "action_head.dit.proj_out")
    assert [name for name in chosen if name.startswith(ends) or ".norm1." in name] == []
    assert not any(isinstance(modules[name], CategorySpecificLinear) for name in chosen)
    for name in ("vlm.vision.blocks.0.qkv", "vlm.vision.blocks.26.fc2", "vlm.layers.0.q_proj",
                 "vlm.layers.11.mlp.down_proj", "action_head.vl_self_attention.3.attn.to_out",
                 "action_head.dit.blocks.0.attn.to_k", "action_head.dit.blocks.15.ff.proj_out"):
        assert name in chosen, name
    # most of the blocks' Linear weights run in FP8: everything but the adaLN modulations
    in_units = sum(m.weight.numel() for unit in policy.parallel_units() for m in unit.modules()
                   if isinstance(m, torch.nn.Linear))
    assert sum(modules[name].weight.numel() for name in chosen) > 0.95 * in_units


def test_dropout_masks_belong_to_the_sample_so_splitting_a_batch_changes_nothing():
    """With the loader's per-sample seeds, GR00T's dropout (0.2 in the full preset) draws each sample's masks from
    its seed: the halves of a batch (what 2 ranks train) give the whole batch's loss and gradients, a packed and
    a padded batch agree, and an activation-checkpointed recompute redraws the same masks."""
    from torch.utils.checkpoint import checkpoint

    policy = tiny_groot(dropout=0.3)
    obs = batch(b=4, tasks=MIXED_TASKS)
    obs["sample_seed"] = torch.tensor([11, 12, 13, 14])
    whole, grads = _loss_and_grads(policy, obs, seed=0)
    # the global RNG is not read (nn.Dropout would draw other masks after another manual_seed)
    torch.testing.assert_close(_loss_and_grads(policy, obs, seed=1)[0], whole, rtol=0, atol=0)
    halves = [{k: v[i:i + 2] for k, v in obs.items()} for i in (0, 2)]
    policy.zero_grad(set_to_none=True)
    total = sum(flow_matching_loss(policy, half)[0] for half in halves) / 2  # equal weights: no padded steps
    total.backward()
    torch.testing.assert_close(total.detach(), whole, rtol=1e-6, atol=1e-7)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # the masks really drop: other seeds, another loss; no dropout, another loss
    other = dict(obs, sample_seed=torch.tensor([21, 22, 23, 24]))
    assert not torch.allclose(_loss_and_grads(policy, other)[0], whole)
    policy.config.packed = not policy.config.packed
    torch.testing.assert_close(_loss_and_grads(policy, obs)[0], whole, rtol=1e-6, atol=1e-7)
    policy.config.packed = not policy.config.packed

    def checkpointed(forward):
        return lambda *args: checkpoint(forward, *args, use_reentrant=False)

    for block in policy.action_head.dit.blocks:  # recomputed in backward, as --activation_checkpointing does
        block.forward = checkpointed(block.forward)
    recomputed, recomputed_grads = _loss_and_grads(policy, obs)
    torch.testing.assert_close(recomputed, whole, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(recomputed_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.allclose(_loss_and_grads(tiny_groot(dropout=0.0), obs)[0], whole)
