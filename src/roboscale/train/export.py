"""`roboscale export`: the consolidated policy of a checkpoint as a standalone ``pretrained_model`` directory
(config.json, model.safetensors, tokenizer.json) that ``roboscale eval`` and ``Policy.from_pretrained`` load.

Every saved step keeps its consolidated weights (gathered from the ranks' shards when it was saved, the EMA
weights when training kept an average), so exporting never needs the ranks or the sharded state; the policy is
loaded strictly (every tensor present, every shape the config implies) before it is written, atomically.
"""

from __future__ import annotations

from pathlib import Path

from roboscale.errors import CheckpointError, ConfigError


def pretrained_dir(checkpoint: Path) -> Path:
    """The ``pretrained_model`` directory a user means by ``checkpoint``."""
    from roboscale.models.policy import CONFIG_NAME
    from roboscale.train.checkpoint import PRETRAINED, last_checkpoint

    checkpoint = Path(checkpoint)
    if (checkpoint / "checkpoints").is_dir():
        last = last_checkpoint(checkpoint)
        if last is None:
            raise CheckpointError(checkpoint / "checkpoints", "has no complete checkpoint (no `last`)")
        checkpoint = last
    if (checkpoint / PRETRAINED).is_dir():
        checkpoint = checkpoint / PRETRAINED
    if not (checkpoint / CONFIG_NAME).is_file():
        raise CheckpointError(checkpoint, f"not a checkpoint: no {CONFIG_NAME} (expected a training output "
                              "directory, a step directory or a pretrained_model directory)")
    return checkpoint


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> Path:
    from roboscale.models.policy import Policy
    from roboscale.train.checkpoint import TRAIN_CONFIG
    from roboscale.utils.io import atomic_directory

    source = pretrained_dir(Path(checkpoint))
    output = Path(output)
    if output.exists():
        raise ConfigError(f"--output {output}: already exists; export writes a new directory")
    policy = Policy.from_pretrained(source)
    with atomic_directory(output) as tmp:
        policy.save_pretrained(tmp)
        if (source / TRAIN_CONFIG).is_file():  # how it was trained travels with it
            (tmp / TRAIN_CONFIG).write_bytes((source / TRAIN_CONFIG).read_bytes())
    return output
