"""Policy registry: one PolicySpec per policy type. The trainer and evaluator know only this module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.pi05 import Pi05Config, Pi05Policy
from roboscale.models.policy import Policy, PolicyConfig
from roboscale.models.tokenizer import TaskTokenizer


@dataclass(frozen=True)
class PolicySpec:
    """What the trainer needs to know about a policy type (torchtitan's ModelSpec pattern)."""

    name: str
    config_class: type[PolicyConfig]
    policy_class: type[Policy]
    build: Callable[[PolicyConfig, object], Policy]
    """build(config, dataset_meta) -> a policy with dataset-derived fields and normalization stats filled in."""


def _fill_from_dataset(cfg: PolicyConfig, meta) -> None:
    """Dataset-derived config fields: cameras, state/action sizes, fps."""
    features = meta.features
    for key in (cfg.state_key, cfg.action_key):
        if key not in features:
            raise ConfigError(f"the dataset at {meta.root} has no feature {key!r} (it has {sorted(features)})")
    if not cfg.image_keys:
        cfg.image_keys = list(meta.camera_keys)
    missing = [k for k in cfg.image_keys if k not in features]
    if missing:
        raise ConfigError(f"cameras {missing} are not in the dataset at {meta.root} (cameras: {meta.camera_keys})")
    cfg.state_dim = cfg.state_dim or int(features[cfg.state_key]["shape"][0])
    cfg.action_dim = cfg.action_dim or int(features[cfg.action_key]["shape"][0])
    cfg.fps = cfg.fps or float(meta.fps)


def build_pi05(cfg: Pi05Config, meta) -> Pi05Policy:
    _fill_from_dataset(cfg, meta)
    if cfg.tokenizer_path:
        tokenizer = TaskTokenizer.from_file(cfg.tokenizer_path)
    else:
        tokenizer = TaskTokenizer.train(meta.task_list, cfg.tokenizer_train_vocab)
    cfg.vocab_size = tokenizer.vocab_size
    policy = Pi05Policy(cfg, tokenizer)
    policy.state_normalizer.set_stats(meta.stats[cfg.state_key], cfg.state_key)
    policy.action_normalizer.set_stats(meta.stats[cfg.action_key], cfg.action_key)
    return policy


POLICIES: dict[str, PolicySpec] = {
    "pi05": PolicySpec("pi05", Pi05Config, Pi05Policy, build_pi05),
}


def get_spec(name: str) -> PolicySpec:
    if name not in POLICIES:
        raise ValueError(f"unknown policy type {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]


def get_policy_class(name: str | None, source: Path | None = None) -> type[Policy]:
    if name not in POLICIES:
        where = source if source is not None else Path("config.json")
        raise CheckpointError(where, f"unknown policy type {name!r}; this roboscale knows {sorted(POLICIES)}")
    return POLICIES[name].policy_class


def build_policy(cfg: PolicyConfig, meta) -> Policy:
    return get_spec(type(cfg).type).build(cfg, meta)


def load_policy(directory: str | Path) -> Policy:
    return Policy.from_pretrained(directory)
