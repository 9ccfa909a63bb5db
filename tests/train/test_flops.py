"""Analytical FLOPs per training sample (roboscale.models.flops, the policies' counts, roboscale.train.flops)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from roboscale.errors import ConfigError
from roboscale.models.objective import flow_matching_loss
from roboscale.models.groot.transform import TOKENS, TOKENS_MASK
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.registry import build_policy, get_spec, preset_config
from roboscale.train import flops as train_flops
from roboscale.train.flops import flops_per_sample, gpu_of, peak_flops
from tests.models.helpers import batch, fake_meta

LONG_TASK = " ".join(["rotate the faucet clockwise and open a drawer"] * 12)  # longer than max_language_tokens


def test_a_tiny_pi05_against_a_count_by_hand():
    cfg = Pi05Config(image_keys=["cam"], image_size=16, vit_patch_size=8, vit_conv_stem=False, vit_dim=16,
                     vit_depth=1, vit_heads=1, vit_mlp_dim=32, pixel_shuffle=1, width=32, depth=2, num_heads=2,
                     num_kv_heads=1, head_dim=16, mlp_dim=64, expert_width=16, expert_mlp_dim=32,
                     max_language_tokens=4, chunk_size=3, state_dim=2, action_dim=2)
    f = flops_per_sample(cfg)
    # vision: 4 patches; patchify 2*4*192*16, block qkv+proj+fc1+fc2 = 6144+2048+4096+4096, projector 2*4*16*32
    assert f["vision"].linear == 24576 + 16384 + 4096
    assert f["vision"].attention == 4 * 4 * 4 * 16
    # prefix of 9 tokens (4 image, 1 state, 4 language): state token 128; layer 0: k/v 18432, q/o 36864,
    # MLP 110592; the last layer only its k/v (18432); attention in layer 0 only
    assert f["language"].linear == 128 + 18432 + 36864 + 110592 + 18432
    assert f["language"].attention == 4 * 9 * 9 * 32
    # actions (3 tokens at width 16): in 192, time MLP 1024, per layer modulations 3072 + q/o 6144 + k/v 3072 +
    # MLP 9216, final modulation 1536, out 192; each layer's 3 queries attend to 9 + 3 keys
    assert f["action"].linear == 192 + 1024 + 2 * (3072 + 6144 + 3072 + 9216) + 1536 + 192
    assert f["action"].attention == 2 * 4 * 3 * 12 * 32
    assert f.forward == 296064
    assert f.training == float(f) == 3 * 296064  # everything trains: forward + backward = 3x


def _counted_forward(policy, data) -> int:
    """FLOPs torch counts in one training forward (the math SDPA backend, whose matmuls the counter sees)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        flow_matching_loss(policy, data)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["pi05", "groot"])
def test_the_count_equals_what_torch_counts_in_a_forward_at_the_nominal_size(name):
    torch.manual_seed(0)
    policy = build_policy(preset_config(name, "tiny"), fake_meta())
    cfg = policy.config
    data = batch(b=3, chunk=cfg.chunk_size, tasks=[LONG_TASK] * 3)
    if name == "groot":  # prompts of exactly max_language_tokens
        data[TOKENS] = torch.ones(3, cfg.max_language_tokens, dtype=torch.long)
        data[TOKENS_MASK] = torch.ones(3, cfg.max_language_tokens, dtype=torch.bool)
    assert _counted_forward(policy, data) == 3 * flops_per_sample(cfg).forward


def test_frozen_components_cost_forward_only_or_input_gradients():
    full = preset_config("groot", "full")
    f = flops_per_sample(full)
    vision, language, action = f["vision"], f["language"], f["action"]
    # GR00T's fine-tuning: the VLM is frozen and nothing upstream of it trains -> forward only
    assert not vision.trains and not language.trains and not language.backprop
    assert vision.training == vision.forward and language.training == language.forward
    assert action.training == 3 * action.forward
    # the language model frozen below a trained ViT: input gradients (2x) for its weights, 3x for attention
    visual = flops_per_sample(preset_config("groot", "full", tune_visual=True))
    assert visual["language"].training == 2 * language.linear + 3 * language.attention
    assert visual["vision"].training == 3 * vision.forward
    assert flops_per_sample(preset_config("groot", "full", tune_llm=True))["language"].training == 3 * language.forward
    # freezing by name applies the same rule
    assert flops_per_sample(preset_config("pi05", "full"), frozen=["vision"])["vision"].training == \
        flops_per_sample(preset_config("pi05", "full"))["vision"].forward


def _weights(policy, prefixes) -> int:
    return sum(p.numel() for n, p in policy.named_parameters() if n.startswith(prefixes) and p.dim() > 1
               and "embed_tokens" not in n and "pos_embed" not in n)


def test_the_full_presets_are_6_x_params_x_tokens():
    """pi0.5 full (3.24 B parameters): ~13.4 TFLOP per training sample, 6 x (weights x tokens each sees) within
    10% (attention adds ~4%); GR00T full: the frozen VLM at 2 x weights x tokens, the head at 6x."""
    cfg = preset_config("pi05", "full")
    f = flops_per_sample(cfg)
    assert 13.0e12 < f.training < 13.8e12
    with torch.device("meta"):
        policy = get_spec("pi05").policy_class()(cfg)
    prefix, suffix = 3 * 256 + 200, 50
    vision = _weights(policy, ("vision", "projector")) * 256 * 3
    language = sum(p.numel() for n, p in policy.named_parameters() if n.startswith("layers.") and "expert" not in n
                   and p.dim() > 1) * prefix
    expert = sum(p.numel() for n, p in policy.named_parameters() if "expert_" in n and "norm" not in n) * suffix
    estimate = 6 * (vision + language + expert)
    assert 1.0 < f.training / estimate < 1.1
    groot = flops_per_sample(preset_config("groot", "full"))
    assert 1.5e12 < groot.training < 1.8e12
    assert groot["vision"].training + groot["language"].training < 0.5 * groot.training  # the head dominates


def test_a_policy_config_without_cameras_is_a_config_error():
    with pytest.raises(ConfigError, match="policy.image_keys is empty"):
        flops_per_sample(preset_config("pi05", "demo"))


def test_peak_flops_from_the_datasheet_on_known_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", "bf16") == (989.5e12, "datasheet: NVIDIA H100 80GB HBM3 dense bf16")
    assert peak_flops("cuda", "fp8")[0] == 1979e12
    assert peak_flops("cuda", "fp32")[0] == 67e12
    torch.set_float32_matmul_precision("high")
    try:
        assert peak_flops("cuda", "fp32")[0] == 494.5e12  # TF32 tensor cores when torch allows them
    finally:
        torch.set_float32_matmul_precision("highest")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match="no FP8"):
        peak_flops("cuda", "fp8")
    names = {"NVIDIA H200": "h200", "NVIDIA H100 NVL": "h100-nvl", "NVIDIA H100 PCIe": "h100-pcie",
             "NVIDIA B200": "b200", "NVIDIA GB200": "gb200", "NVIDIA L40S": "l40s", "NVIDIA L4": "l4"}
    assert {name: gpu_of(name).key for name in names} == names
    with pytest.raises(ConfigError, match="precision must be one of"):
        peak_flops("cpu", "int4")


def test_peak_flops_on_cpu_is_a_cached_measured_gemm_rate():
    rate, source = peak_flops("cpu", "fp32")
    assert rate > 1e8 and source.startswith("measured:") and "GEMM" in source
    calls = train_flops.measured_gemm_flops.cache_info().hits
    assert peak_flops("cpu", "fp8")[0] == rate  # emulated FP8 runs fp32 GEMMs: the same cached measurement
    assert train_flops.measured_gemm_flops.cache_info().hits == calls + 1
