"""Fine-tuning: a policy that starts from a pretrained checkpoint (``--policy.pretrained_path=DIR``), adapted to the
training dataset the way openpi and LeRobot adapt pi0.5 / GR00T base checkpoints.

What comes from where:

- **Architecture, weights and tokenizer**: the checkpoint's (ours, or LeRobot's pi0.5 through the registry's
  ``Foreign`` adapter). Options given with it that would change them (``--policy.width=128`` on a width-48
  checkpoint) are a ConfigError naming each; options in the config class's ``finetune_options`` (action steps,
  Euler steps, attention kernel, packing, normalization modes, ...) may differ. An option is "given" when it differs
  from its default (an option set to its default value takes the checkpoint's).
- **State/action sizes**: the checkpoint's, which are padded maxima (full presets: pi0.5 32/32, GR00T 64/32). A
  narrower dataset is recorded as ``dataset_state_dim`` / ``dataset_action_dim``: the normalizers zero-pad its
  values to the checkpoint's size on the way in (training and inference) and crop predicted actions back to the
  dataset's width (``roboscale.models.normalize``), so the saved fine-tuned policy predicts dataset-width actions.
  The flow-matching loss covers every dimension, padded ones included (openpi's choice: the velocity of a padded
  dimension is learned too, so inference, which integrates every dimension, sees what training saw). A wider
  dataset is a ConfigError.
- **Normalization statistics**: the training dataset's.
- **Cameras**: the dataset's cameras (``--policy.image_keys``, default all) take the checkpoint's image slots: a
  camera named like a slot takes that slot, the others the free slots in order. A slot left without a camera is
  dropped from ``image_keys``, which computes exactly what an always-masked slot computes (no slot-specific weights;
  masked slots take no positions). More cameras than slots is a ConfigError. Frames of another size are resized to
  the checkpoint's ``image_size`` on the fly.
- **fps**: the dataset's (or ``--policy.fps``, checked against it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from roboscale.config import from_dict, to_dict
from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.models.normalize import Normalizer
from roboscale.models.policy import CONFIG_NAME, Policy, read_policy_config
from roboscale.models.registry import feature_size, fit_to_dataset, spec_of_checkpoint

OPTION = "--policy.pretrained_path"
# Fields fine-tuning sets itself (from the dataset, the tokenizer or the run), not compared with the checkpoint's.
_OWN = frozenset({"pretrained_path", "image_keys", "fps", "tokenizer_path", "tokenizer_train_vocab",
                  "dataset_state_dim", "dataset_action_dim"})
_NORMALIZATION = ("state_norm", "action_norm")


def policy_for_finetuning(cfg: PolicyConfig, meta: Any) -> Policy:
    """The checkpoint at ``cfg.pretrained_path`` adapted to the dataset ``meta`` describes (features, stats, fps,
    cameras: what ``build_policy`` reads). ``cfg`` is updated in place to the policy's config (the checkpoint's
    architecture with the dataset's fields), and the returned policy's ``config`` is ``cfg``, as ``build_policy``
    fills ``cfg``."""
    if not cfg.pretrained_path:
        raise ConfigError(f"{OPTION} is not set: nothing to fine-tune from")
    directory = Path(cfg.pretrained_path)
    config_dict = read_policy_config(directory)
    spec = spec_of_checkpoint(config_dict, directory / CONFIG_NAME)
    kind = type(cfg).type
    if spec.name != kind:
        raise ConfigError(f"{OPTION}={directory} is a {spec.name!r} policy, but --policy.type is {kind!r}; add "
                          f"--policy.type={spec.name}")
    foreign = spec.foreign if spec.foreign is not None and spec.foreign.detect(config_dict) else None
    saved = _checkpoint_config(config_dict, directory, foreign)
    merged = _merge_options(cfg, saved, directory, foreign is not None)
    _fit_widths_and_cameras(merged, saved, cfg, meta, directory)
    fit_to_dataset(merged, meta)  # cameras present, widths, fps
    if meta.stats is None:
        raise ConfigError(f"the dataset at {meta.root} has no normalization statistics (meta/stats.json)")

    # Load with the checkpoint's normalization modes (its statistics are tensors of the checkpoint), then give the
    # policy fresh normalizers in the run's modes and widths, filled from the dataset.
    modes = [n for n in _NORMALIZATION if hasattr(merged, n)]
    load_config = dataclasses.replace(merged, **{n: getattr(saved, n) for n in modes})
    if foreign is not None:
        overrides: dict[str, Any] = {"config": load_config}
        if cfg.tokenizer_path:
            overrides["tokenizer_path"] = cfg.tokenizer_path
    else:
        overrides = {f.name: to_dict(getattr(load_config, f.name)) for f in dataclasses.fields(load_config)
                     if not _same(getattr(load_config, f.name), getattr(saved, f.name))}
    policy = Policy.from_pretrained(directory, **overrides)
    for attr, dim, mode, data_dim in (("state", merged.state_dim, "state_norm", merged.dataset_state_dim),
                                      ("action", merged.action_dim, "action_norm", merged.dataset_action_dim)):
        old = getattr(policy, f"{attr}_normalizer")
        setattr(policy, f"{attr}_normalizer", Normalizer(dim, getattr(merged, mode, old.mode), data_dim=data_dim))
    # the loaded config (a foreign loader may complete it: the tokenizer's vocabulary) with the run's modes
    final = dataclasses.replace(policy.config, **{n: getattr(merged, n) for n in modes})
    for f in dataclasses.fields(cfg):
        setattr(cfg, f.name, getattr(final, f.name))
    policy.config = cfg
    policy.set_normalization(meta.stats)
    return policy


def _checkpoint_config(config_dict: dict, directory: Path, foreign) -> PolicyConfig:
    """The config the checkpoint's policy is built with."""
    where = directory / CONFIG_NAME
    if foreign is not None:
        reader = foreign.config_reader()
        if reader is None:
            raise CheckpointError(where, "fine-tuning does not read this framework's checkpoints")
        return reader(config_dict, where)
    try:
        return from_dict(PolicyConfig, config_dict, where=str(where))
    except ConfigError as exc:
        raise CheckpointError(where, str(exc)) from None


def _merge_options(cfg: PolicyConfig, saved: PolicyConfig, directory: Path, foreign: bool) -> PolicyConfig:
    """The checkpoint's config with the options given in ``cfg`` that fine-tuning may change; a ConfigError naming
    every given option that contradicts the checkpoint."""
    defaults = type(cfg)()
    allowed = type(cfg).finetune_options
    changes: dict[str, Any] = {}
    conflicts = []
    for f in dataclasses.fields(cfg):
        name, value = f.name, getattr(cfg, f.name)
        if name in _OWN or _same(value, getattr(defaults, name)):
            continue
        if name in allowed:
            changes[name] = value
        elif not _same(value, getattr(saved, name)):
            conflicts.append(f"--policy.{name}={_shown(value)} (checkpoint: {_shown(getattr(saved, name))})")
    tokenizer_options = [n for n in ("tokenizer_path", "tokenizer_train_vocab") if hasattr(cfg, n)
                         and not _same(getattr(cfg, n), getattr(defaults, n))
                         and not _same(getattr(cfg, n), getattr(saved, n))]
    if foreign and "tokenizer_path" in tokenizer_options:
        tokenizer_options.remove("tokenizer_path")  # LeRobot's checkpoints do not bring their tokenizer
    conflicts += [f"--policy.{n}={_shown(getattr(cfg, n))} (the checkpoint brings its tokenizer)"
                  for n in tokenizer_options]
    if conflicts:
        raise ConfigError(f"{OPTION}={directory}: {', '.join(conflicts)} contradict the checkpoint's architecture; "
                          "leave them out to keep the checkpoint's")
    changes["pretrained_path"] = cfg.pretrained_path
    if hasattr(cfg, "tokenizer_path"):
        changes["tokenizer_path"] = cfg.tokenizer_path
    changes["fps"] = cfg.fps  # the dataset's (0: filled from it)
    try:
        return dataclasses.replace(saved, **changes)  # __post_init__ checks the combination
    except ConfigError as exc:
        raise ConfigError(f"{OPTION}={directory}: {exc}") from None


def _fit_widths_and_cameras(merged: PolicyConfig, saved: PolicyConfig, cfg: PolicyConfig, meta: Any,
                            directory: Path) -> None:
    """The dataset's state/action widths (zero-padded up to the checkpoint's sizes) and cameras (on its slots)."""
    for name, key in (("state_dim", merged.state_key), ("action_dim", merged.action_key)):
        size, room = feature_size(meta, key), getattr(saved, name)
        if size > room:
            raise ConfigError(f"{key!r} of the dataset at {meta.root} has {size} values, more than the {room} of the "
                              f"checkpoint (policy.{name}) at {OPTION}={directory}")
        setattr(merged, f"dataset_{name}", size if size < room else 0)
    cameras = list(cfg.image_keys) or list(meta.camera_keys)
    slots = list(saved.image_keys)
    if len(cameras) > len(slots):
        raise ConfigError(f"the dataset at {meta.root} has {len(cameras)} cameras {cameras} but the checkpoint at "
                          f"{OPTION}={directory} has {len(slots)} image slots {slots}: choose at most {len(slots)} "
                          "with --policy.image_keys")
    placed = {slots.index(c): c for c in cameras if c in slots}
    free = iter(i for i in range(len(slots)) if i not in placed)
    placed.update({next(free): c for c in cameras if c not in slots})
    merged.image_keys = [placed[i] for i in sorted(placed)]


def _same(a: Any, b: Any) -> bool:
    return to_dict(a) == to_dict(b)


def _shown(value: Any) -> str:
    return json.dumps(to_dict(value))
