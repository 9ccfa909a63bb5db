"""`roboscale export`: the consolidated policy of a checkpoint as a standalone ``pretrained_model`` directory
(config.json, model.safetensors, tokenizer.json) that ``roboscale eval`` and ``Policy.from_pretrained`` load, or
(``--format=lerobot``) in another framework's format, through the policy registry's ``Foreign`` adapter.

Every saved step keeps its consolidated weights (gathered from the ranks' shards when it was saved, the EMA
weights when training kept an average), so exporting never needs the ranks or the sharded state; the policy is
loaded strictly (every tensor present, every shape the config implies) before it is written, atomically.
"""

from __future__ import annotations

from pathlib import Path

import logging

from roboscale.configs.model import OnnxExportOptions
from roboscale.errors import ConfigError

log = logging.getLogger(__name__)

OURS = "roboscale"
ONNX = "onnx"


def export_formats(policy_type: str) -> list[str]:
    """``--format`` values for a policy type: ours, and each framework its registry entry can write."""
    from roboscale.models.registry import get_spec

    spec = get_spec(policy_type)
    foreign = spec.foreign
    return ([OURS] + ([ONNX] if spec.onnx else [])
            + ([foreign.format] if foreign is not None and foreign.save else []))


def export_checkpoint(checkpoint: str | Path, output: str | Path, format: str = OURS,
                      onnx: OnnxExportOptions | None = None) -> Path:
    from roboscale.models.policy import Policy, resolve_checkpoint
    from roboscale.models.registry import get_spec
    from roboscale.train.checkpoint import TRAIN_CONFIG
    from roboscale.utils.io import atomic_directory

    source = resolve_checkpoint(checkpoint)
    output = Path(output)
    if output.exists():
        raise ConfigError(f"--output {output}: already exists; export writes a new directory")
    policy = Policy.from_pretrained(source)
    formats = export_formats(policy.name)
    if format not in formats:
        raise ConfigError(f"--format: {format!r} is not one of {formats} (the formats a {policy.name} policy "
                          "exports to)")
    if format == ONNX:
        from roboscale.deploy.export import export_onnx

        options = onnx or OnnxExportOptions()
        report = export_onnx(source, output, attention_backend=options.attention_backend, rtc=options.rtc,
                             unrolled=options.unrolled, preferred_graph=options.preferred_graph,
                             tolerance=options.tolerance, policy=policy, source=source)
        log.info("exported in %.0f s; actions against PyTorch (relative error): %s", report.seconds,
                 ", ".join(f"{k} {v:.1e}" for k, v in report.errors.items()))
        return output
    with atomic_directory(output) as tmp:
        if format == OURS:
            policy.save_pretrained(tmp)
            if (source / TRAIN_CONFIG).is_file():  # how it was trained travels with it
                (tmp / TRAIN_CONFIG).write_bytes((source / TRAIN_CONFIG).read_bytes())
        else:
            get_spec(policy.name).foreign.saver()(policy, tmp)
    return output
