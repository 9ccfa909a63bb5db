import re

import pytest

from roboscale.config import ConfigError
from roboscale.models.info import model_info


def test_full_size_pi05_matches_the_published_parameter_count():
    text = model_info("pi05", "full")
    ours = float(re.search(r"pi05 \(full\): ([\d.]+) B parameters", text)[1])
    lerobot_way = float(re.search(r"Counted LeRobot's way: ([\d.]+) B without the lm_head", text)[1])
    assert 3.2 < ours < 3.3  # what we build: nothing that feeds nothing
    assert abs(lerobot_way - 3.35) < 0.01  # LeRobot's effective pi0.5 size
    for component in ("vision encoder (ViT)", "language model layers", "action expert layers", "token embeddings"):
        assert component in text
    assert re.search(r"vision encoder \(ViT\)\s+41\d\.\d+ M", text)  # SigLIP So400m ~412M


def test_overrides_and_unknown_presets():
    small = model_info("pi05", "demo", {"depth": "2"})
    assert re.search(r"pi05 \(demo\): [\d.]+ M parameters", small)
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        model_info("pi05", "huge")


def test_full_size_groot_is_gr00t_n15_sized_with_its_breakdown():
    text = model_info("groot", "full")
    built = float(re.search(r"groot \(full\): ([\d.]+) B parameters", text)[1])
    with_lm_head = float(re.search(r"With the lm_head counted .*?: ([\d.]+) B", text, re.S)[1])
    trainable = float(re.search(r"tune_visual=False: ([\d.]+) B", text)[1])
    assert 2.35 < built < 2.45  # what we build: nothing that feeds nothing
    assert 2.65 < with_lm_head < 2.75  # the design's ~2.7 B counts Qwen3's (tied) lm_head
    assert 1.0 < trainable < 1.1  # the VLM is frozen at full size: the action head trains
    assert re.search(r"language model layers\s+604\.\d+ M", text)  # 12 Qwen3-1.7B layers
    assert re.search(r"vision encoder \(ViT\)\s+41\d\.\d+ M", text)  # SigLIP So400m ~412M
    for component in ("DiT", "VL LayerNorm + self-attention", "state/action encoders + decoder", "token embeddings",
                      "image projector (mlp1)"):
        assert component in text


def test_demo_and_tiny_groot_are_small():
    for preset in ("demo", "tiny"):
        text = model_info("groot", preset)
        assert float(re.search(rf"groot \({preset}\): ([\d.]+) M parameters", text)[1]) < 5
    deeper = model_info("groot", "demo", {"dit_layers": "8"})
    assert "DiT" in deeper
