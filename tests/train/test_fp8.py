"""FP8 training (roboscale.train.fp8): which layers convert, and that emulated FP8 trains like fp32."""

import pytest
import torch
from torch import nn

from roboscale.errors import ConfigError
from roboscale.models.objective import flow_matching_loss
from roboscale.models.registry import build_policy, preset_config
from roboscale.train.fp8 import (
    apply_fp8,
    check_fp8_device,
    converted_layers,
    fp8_after_optimizer_step,
    fp8_filter_of,
)
from tests.models.helpers import batch, fake_meta

CPU = torch.device("cpu")

PI05_BLOCK = ["k_proj", "v_proj", "q_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
              "expert_q_proj", "expert_k_proj", "expert_v_proj", "expert_o_proj", "expert_mlp.gate_proj",
              "expert_mlp.up_proj", "expert_mlp.down_proj"]
VIT_BLOCK = ["qkv", "proj", "fc1", "fc2"]
QWEN_BLOCK = ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
ATTENTION_FF = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "ff.proj_in", "ff.proj_out"]

EXPECTED = {
    # tiny pi0.5 (2 joint layers): every block Linear; the last layer has no prefix queries, output or MLP
    "pi05": {*(f"vision.blocks.0.{n}" for n in VIT_BLOCK), *(f"layers.0.{n}" for n in PI05_BLOCK),
             *(f"layers.1.{n}" for n in PI05_BLOCK if n.startswith(("k_", "v_", "expert")))},
    # tiny GR00T: ViT, 2 LLM layers, 1 VL self-attention block, 2 DiT blocks (not their adaLN modulations)
    "groot": {*(f"vlm.vision.blocks.0.{n}" for n in VIT_BLOCK), *(f"vlm.layers.{i}.{n}" for i in (0, 1)
                                                                     for n in QWEN_BLOCK),
              *(f"action_head.vl_self_attention.0.{n}" for n in ATTENTION_FF),
              *(f"action_head.dit.blocks.{i}.{n}" for i in (0, 1) for n in ATTENTION_FF)},
}

# what the issue names: the vision stem, the first and last layers, the action in/out projections
NEVER = {
    "pi05": ["vision.patch_embed", "projector", "state_proj", "action_in_proj", "action_out_proj", "time_mlp.0",
             "time_mlp.2", "layers.0.expert_input_norm.modulation", "expert_norm.modulation"],
    "groot": ["vlm.vision.patch_embed", "vlm.projector.0", "action_head.state_encoder.layer1",
              "action_head.action_encoder.W1", "action_head.action_decoder.layer2",
              "action_head.dit.timestep_encoder.linear_1", "action_head.dit.proj_out_1", "action_head.dit.proj_out_2",
              "action_head.dit.blocks.0.norm1.linear"],
}


def tiny(name: str):
    torch.manual_seed(0)
    return build_policy(preset_config(name, "tiny"), fake_meta())


@pytest.mark.parametrize("name", ["pi05", "groot"])
def test_the_filter_converts_exactly_the_block_layers_of_a_tiny_policy(name):
    policy = tiny(name)
    assert apply_fp8(policy, device=CPU, fsdp=False) == []  # tiny widths are below FP8_MIN_FEATURES
    assert converted_layers(policy) == []
    converted = apply_fp8(policy, device=CPU, fsdp=False, min_features=16)
    assert set(converted) == EXPECTED[name]
    assert set(converted_layers(policy)) == EXPECTED[name]
    # parameter names (hence checkpoints) are unchanged by the swap
    assert f"{min(EXPECTED[name])}.weight" in dict(policy.named_parameters())


@pytest.mark.parametrize("name", ["pi05", "groot"])
def test_excluded_layers_never_convert_at_any_width(name):
    chosen = fp8_filter_of(tiny(name), min_features=1)
    wide = nn.Linear(2048, 2048)
    for layer in NEVER[name]:
        assert not chosen(layer, wide), layer
    assert chosen(min(EXPECTED[name]), wide)
    assert not chosen(min(EXPECTED[name]), nn.Linear(2048, 2040))  # not a multiple of 16


def _train(fp8: bool, steps: int = 30) -> list[float]:
    policy = tiny("pi05")
    if fp8:
        assert apply_fp8(policy, device=CPU, fsdp=False, min_features=16)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    fixed = batch(b=8, chunk=policy.config.chunk_size)
    torch.manual_seed(1)  # the same noise and flow times for both runs
    losses = []
    for _ in range(steps):
        loss, _ = flow_matching_loss(policy, fixed)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_emulated_fp8_training_lowers_the_loss_like_fp32():
    reference, fp8 = _train(fp8=False), _train(fp8=True)
    first, last = sum(fp8[:5]) / 5, sum(fp8[-10:]) / 10
    assert last < 0.8 * first
    ref_last = sum(reference[-10:]) / 10
    assert abs(last - ref_last) < 0.03 * ref_last  # within 3% of fp32 (measured: < 1%)


def test_fsdp_float8_all_gather_is_configured_and_the_step_hook_runs_without_fsdp():
    from torchao.float8.float8_linear import Float8Linear

    policy = tiny("pi05")
    apply_fp8(policy, device=CPU, fsdp=True, min_features=16)
    layers = [m for m in policy.modules() if isinstance(m, Float8Linear)]
    assert layers and all(m.config.enable_fsdp_float8_all_gather and m.config.emulate for m in layers)
    loss, _ = flow_matching_loss(policy, batch(b=2, chunk=policy.config.chunk_size))
    loss.backward()
    fp8_after_optimizer_step(policy)  # no sharded weights: nothing to precompute, no error


def test_a_gpu_without_fp8_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"--fp8: NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no FP8"):
        check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda"))  # Hopper
