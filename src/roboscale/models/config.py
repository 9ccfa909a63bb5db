"""``PolicyConfig``: the options every policy has. A light module (dataclasses only): configs import it, and
the registry (``roboscale.models.registry``) makes each policy's subclass selectable as ``--policy.type``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from roboscale.errors import ConfigError

LOSS_ACTION_DIMS = ("auto", "all", "dataset")


@dataclass
class PolicyConfig:
    """Options every policy has. Each policy's subclass is listed in ``roboscale.models.registry``."""

    finetune_options: ClassVar[frozenset[str]] = frozenset({"state_key", "action_key", "chunk_size",
                                                             "n_action_steps", "loss_action_dims"})
    """Options a fine-tuning run (``pretrained_path``) may set to other values than the checkpoint's: they do not
    change its weights' shapes or meaning (each subclass adds its own). Any other option given must equal the
    checkpoint's (``roboscale.models.finetune``)."""

    image_keys: list[str] = field(default_factory=list)
    """Camera features the policy reads (empty: every camera of the training dataset)."""
    state_key: str = "observation.state"
    """Proprioceptive state feature."""
    action_key: str = "action"
    """Action feature."""
    state_dim: int = 0
    """State size (0: from the dataset)."""
    action_dim: int = 0
    """Action size (0: from the dataset)."""
    dataset_state_dim: int = 0
    """The dataset's state size when smaller than state_dim (a checkpoint's padded maximum, e.g. pi0.5's 32): the
    state is zero-padded up to state_dim. 0: the same as state_dim. Set by fine-tuning (pretrained_path)."""
    dataset_action_dim: int = 0
    """The dataset's action size when smaller than action_dim: actions are zero-padded up to action_dim for training
    and predictions are cropped back to this size. 0: the same as action_dim. Set by fine-tuning (pretrained_path)."""
    loss_action_dims: str = "auto"
    """The action dimensions the flow-matching loss averages over when actions are zero-padded to a checkpoint's
    width (dataset_action_dim): "all" (openpi's choice: the padded dimensions' velocity is learned too, so
    inference, which integrates every dimension, sees what training saw), "dataset" (LeRobot's: the dataset's
    dimensions only), or "auto": the convention of the checkpoint's framework (a LeRobot checkpoint: dataset;
    ours: all)."""
    image_size: int = 64
    """Square input resolution; frames of another size are resized on the fly."""
    chunk_size: int = 16
    """Actions predicted per inference call."""
    n_action_steps: int = 4
    """Actions executed from each predicted chunk before predicting again (the action queue length). Re-planning
    every 4 of the 16 steps (50 ms at 80 Hz) corrects small contact errors (docs/benchmarks.md compares 8)."""
    fps: float = 0.0
    """Dataset frame rate (0: from the dataset); with chunk_size it defines the action window."""
    value_head_dim: int = 0
    """Hidden width of a value head (PPO's critic) on the policy's features; 0: none. `roboscale rl
    --rl.algorithm=ppo` adds one to a checkpoint without it."""
    pretrained_path: str | None = None
    """Start from this pretrained_model directory (ours or LeRobot's pi05): its architecture and weights;
    normalization statistics come from the training dataset."""

    def __post_init__(self) -> None:
        if self.loss_action_dims not in LOSS_ACTION_DIMS:
            raise ConfigError(f"policy.loss_action_dims: {self.loss_action_dims!r} is not one of "
                              f"{list(LOSS_ACTION_DIMS)}")

    def loss_action_width(self) -> int:
        """How many leading action dimensions the loss averages over (``loss_action_dims``)."""
        if self.loss_action_dims == "dataset" and self.dataset_action_dim:
            return self.dataset_action_dim
        return self.action_dim
