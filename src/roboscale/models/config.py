"""``PolicyConfig``: the options every policy has. A light module (dataclasses only): configs import it, and
the registry (``roboscale.models.registry``) makes each policy's subclass selectable as ``--policy.type``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PolicyConfig:
    """Options every policy has. Each policy's subclass is listed in ``roboscale.models.registry``."""

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
    image_size: int = 64
    """Square input resolution; frames of another size are resized on the fly."""
    chunk_size: int = 16
    """Actions predicted per inference call."""
    n_action_steps: int = 4
    """Actions executed from each predicted chunk before predicting again (the action queue length). Re-planning
    every 4 of the 16 steps (50 ms at 80 Hz) corrects small contact errors (docs/benchmarks.md compares 8)."""
    fps: float = 0.0
    """Dataset frame rate (0: from the dataset); with chunk_size it defines the action window."""
