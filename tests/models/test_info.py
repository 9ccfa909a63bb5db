import re

import pytest

from roboscale.config import ConfigError
from roboscale.models.info import ModelInfoConfig, model_info


def test_full_size_pi05_matches_the_published_parameter_count():
    text = model_info(ModelInfoConfig(policy="pi05", preset="full"))
    ours = float(re.search(r"pi05 \(full\): ([\d.]+) B parameters", text)[1])
    lerobot_way = float(re.search(r"Counted LeRobot's way: ([\d.]+) B without the lm_head", text)[1])
    assert 3.2 < ours < 3.3  # what we build: nothing that feeds nothing
    assert abs(lerobot_way - 3.35) < 0.01  # LeRobot's effective pi0.5 size
    for component in ("vision encoder (ViT)", "language model layers", "action expert layers", "token embeddings"):
        assert component in text
    assert re.search(r"vision encoder \(ViT\)\s+41\d\.\d+ M", text)  # SigLIP So400m ~412M


def test_overrides_and_unknown_presets():
    small = model_info(ModelInfoConfig(policy="pi05", preset="demo", overrides={"depth": "2"}))
    assert re.search(r"pi05 \(demo\): [\d.]+ M parameters", small)
    with pytest.raises(ConfigError, match="no preset 'huge'"):
        model_info(ModelInfoConfig(policy="pi05", preset="huge"))
