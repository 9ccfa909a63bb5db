"""Instruction variants: other phrasings of a dataset's task strings, read in training instead of the recorded one.

A policy trained on one instruction per scene learns the string as a name for the scene, and a paraphrase it never
saw ("grab the soup and put it into the basket") becomes noise to it (docs/benchmarks.md, LIBERO-Pro robustness).
A JSON file maps each task string of the data to its other phrasings, e.g. written by hand or by a language model::

    {"pick up the ketchup and place it in the basket": ["grab the ketchup and put it in the basket", ...]}

Every training sample whose task has variants reads one of them, or the recorded string, chosen uniformly from the
sample's seed: the same sample reads the same phrasing on every world size and after a resume. The tokenizer of a
policy built for the data is trained on the variants too. Tasks the file does not name keep their own string.
The file is JSON, read as data: nothing in it is imported or executed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.errors import ConfigError

OPTION = "--dataset.instruction_variants"
_STREAM = 0x1A5C  # keys the variant draw apart from the flow-matching noise and time drawn from the same seed


def load_instruction_variants(path: str | Path, tasks: list[str]) -> dict[str, list[str]]:
    """The file's ``task -> [phrasing, ...]``, checked against the data's task strings (a key the data does not
    have is an error: a typo would otherwise train without the variants, silently)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{OPTION}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{OPTION}: {path} is not a JSON file: {e}") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{OPTION}: {path} must hold a non-empty JSON object: task string -> list of phrasings")
    known = set(tasks)
    variants: dict[str, list[str]] = {}
    for task, phrasings in raw.items():
        if task not in known:
            raise ConfigError(f"{OPTION}: {path} names the task {task!r}, which the data does not have (its tasks: "
                              f"{', '.join(repr(t) for t in sorted(known))})")
        if (not isinstance(phrasings, list) or not phrasings
                or not all(isinstance(p, str) and p.strip() for p in phrasings)):
            raise ConfigError(f"{OPTION}: {path}: the phrasings of {task!r} must be a non-empty list of non-empty "
                              "strings")
        variants[task] = list(dict.fromkeys(p for p in phrasings if p != task))  # the recorded one is always a choice
    return variants


def phrasings(variants: dict[str, list[str]]) -> list[str]:
    """Every variant: what a tokenizer is trained on beside the data's own task strings."""
    return [p for options in variants.values() for p in options]


class InstructionVariants:
    """A sample transform that reads the sample's task as one of its phrasings, then applies ``then`` (the policy's
    own transform, which tokenizes it). Picklable, for loader worker processes."""

    def __init__(self, variants: dict[str, list[str]], then: Callable[[dict], Any] | None = None):
        self.variants = variants
        self.then = then

    def __call__(self, sample: dict) -> Any:
        options = self.variants.get(sample["task"])
        if options:
            choice = int(np.random.default_rng((_STREAM, int(sample["sample_seed"]))).integers(len(options) + 1))
            if choice:  # 0: the recorded string
                sample["task"] = options[choice - 1]
        return sample if self.then is None else self.then(sample)


class VariantsFingerprint:
    """Checkpointed with a run that reads variants: their sha256. The resume check compares the option, which names
    a path; an edited file at the same path would make the resumed run read other phrasings than the run it
    continues, so the resume refuses it."""

    def __init__(self, variants: dict[str, list[str]]):
        self.sha256 = hashlib.sha256(json.dumps(variants, sort_keys=True).encode()).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["sha256"] != self.sha256:
            raise ValueError(f"the phrasings of {OPTION} changed since this checkpoint was written; a resumed run "
                             "continues the same run: restore the file, or train into a new --output_dir")
