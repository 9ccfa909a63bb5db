"""Checkpoints written by an earlier roboscale still load and act the same.

tests/fixtures/checkpoints/{pi05,groot}-v0.1 were trained (2 steps, tiny presets) and saved by the code as it was
before the policies moved onto the Policy contract (commit f7cdde4): normalizer statistics under ``a``/``b``,
the flow-matching loss inside ``forward``, pi0.5 as one module. ``expected_actions.safetensors`` holds what that
code predicted for ``tests.models.helpers.batch(b=2, seed=11)`` after ``torch.manual_seed(0)``: bit-identical on
the CPU that recorded it, within float32 rounding (2.4e-7 seen) on CPUs whose kernels reduce in another order.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roboscale.models.policy import Policy
from tests.models.helpers import batch

FIXTURES = Path(__file__).parents[1] / "fixtures" / "checkpoints"


@pytest.mark.parametrize("name", ["pi05", "groot"])
def test_an_old_checkpoint_loads_and_predicts_what_it_predicted(name):
    directory = FIXTURES / f"{name}-v0.1"
    policy = Policy.from_pretrained(directory).eval()
    assert policy.name == name
    obs = batch(b=2, chunk=policy.config.chunk_size, seed=11)
    torch.manual_seed(0)
    actions = policy.predict_action_chunk(obs)
    torch.testing.assert_close(actions, load_file(str(directory / "expected_actions.safetensors"))["actions"],
                               rtol=1e-5, atol=1e-6)
