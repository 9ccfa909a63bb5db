"""`roboscale demo`: the closed loop's options (generation, training, evaluation, all under one directory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roboscale.configs.data import GenerateConfig
from roboscale.configs.eval import EvalConfig
from roboscale.configs.train import TrainConfig


@dataclass
class DemoConfig:
    """`roboscale demo`: generate demos, train a pi0.5-style policy, evaluate it untrained and trained."""

    output_dir: str = "outputs/demo"
    """Everything goes here: data/, train/ (with the trained checkpoint's evaluation in train/eval/step_<N>/),
    eval_untrained/, eval_swapped_instructions/."""
    data: GenerateConfig = field(default_factory=GenerateConfig)
    """Demonstration generation (its `out` is set to <output_dir>/data)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training (its dataset and output_dir are set under <output_dir>)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(episodes=20))
    """Evaluation (its tasks are the demo's tasks)."""
    reuse_data: bool = True
    """Reuse <output_dir>/data if a complete dataset is already there."""
    evaluate_untrained: bool = True
    """Also evaluate the untrained policy (the table's first column; skip it for large task sets)."""
    language_check: bool = True
    """Also evaluate the instruction-only pairs with swapped instructions (success should collapse)."""
