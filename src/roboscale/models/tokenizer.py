"""Language tokenizer: a small byte-level BPE trained on the dataset's task strings, or a tokenizer.json from disk.

Byte-level BPE never meets an unknown character, so paraphrased or new instructions still tokenize. The trained
tokenizer is saved as ``tokenizer.json`` next to the policy weights; a PaliGemma/Qwen ``tokenizer.json`` a user
has on disk loads the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from roboscale.errors import CheckpointError

PAD, BOS = "<pad>", "<bos>"
TASK_CACHE_SIZE = 4096


def normalize_task(text: str) -> str:
    """pi0.5's prompt cleaning: underscores to spaces, one line. (Our trained tokenizer also lower-cases, inside
    its own normalizer, so a PaliGemma or Qwen tokenizer.json sees the text with its case.)"""
    return " ".join(text.replace("_", " ").split())


class TaskTokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer
        pad = tokenizer.token_to_id(PAD)
        self.pad_id = 0 if pad is None else pad
        self.bos_id = tokenizer.token_to_id(BOS)
        self._task_ids: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 512) -> TaskTokenizer:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD, BOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator([normalize_task(t) for t in texts], trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> TaskTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(
                path, "tokenizer file not found; point --policy.tokenizer_path at a Hugging Face tokenizer.json"
            )
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise CheckpointError(
                path,
                f"not a valid tokenizer.json ({exc}); use the tokenizer.json of a Hugging Face tokenizer "
                "(e.g. PaliGemma's or Qwen's), or leave --policy.tokenizer_path empty to train one on the tasks",
            ) from None

    def save(self, path: str | Path) -> None:
        from roboscale.utils.io import atomic_write_bytes

        atomic_write_bytes(path, self._tok.to_str(pretty=False).encode())

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` it wraps (what an exported policy's runtime tokenizes with)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, clean: bool = True) -> list[int]:
        """``<bos>`` (where the vocabulary has one) and the ids of ``text``, cleaned by ``normalize_task`` unless
        ``clean`` is False (pi0.5's prompt: its template's newline and trailing space are part of it)."""
        ids = self._tok.encode(normalize_task(text) if clean else text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def task_ids(self, task: str, max_length: int) -> torch.Tensor:
        """long [L <= max_length]: the ids of a task string. Loader workers ask for the same few task strings every
        step, so they are kept (a bounded number per process: a stray string never grows it unboundedly)."""
        key = (task, max_length)
        ids = self._task_ids.get(key)
        if ids is None:
            ids = torch.tensor(self.encode(task)[:max_length], dtype=torch.long)
            if len(self._task_ids) < TASK_CACHE_SIZE:
                self._task_ids[key] = ids
        return ids

    def encode_batch(self, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids [B, L] and a bool mask (True = real), L = longest in the batch (<= max_length)."""
        return pad_token_ids([self.encode(t)[:max_length] for t in texts], self.pad_id)


def pad_token_ids(encoded: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and a bool mask (True = real), L = the longest sequence (at least 1)."""
    length = max(1, max((len(e) for e in encoded), default=0))
    ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), length), dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.as_tensor(e, dtype=torch.long)
        mask[i, : len(e)] = True
    return ids, mask
