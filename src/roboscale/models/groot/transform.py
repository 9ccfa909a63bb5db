"""GR00T's per-sample transform and per-batch collate, run in the loader's workers: tokenization happens there,
never in the training loop. Images, state and actions pass through untouched; the policy normalizes them on its
device."""

from __future__ import annotations

from typing import Any

import torch

from roboscale.models.tokenizer import TaskTokenizer, pad_token_ids

TOKENS = "observation.language.tokens"
"""Batch key of the instruction's token ids: long [L] per sample, [B, L] right-padded per batch."""
TOKENS_MASK = "observation.language.attention_mask"
"""Batch key of the mask of real (not padding) tokens, bool [B, L]."""

class GrootTransform:
    """The instruction becomes token ids (cut to ``max_language_tokens``). Picklable (a ``tokenizers`` tokenizer
    and ints), so each loader worker carries its own."""

    def __init__(self, tokenizer: TaskTokenizer, max_language_tokens: int):
        self.tokenizer = tokenizer
        self.max_language_tokens = max_language_tokens

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if TOKENS in sample:
            return sample
        sample[TOKENS] = self.tokenizer.task_ids(sample["task"], self.max_language_tokens)
        return sample


class GrootCollate:
    """Stacks samples as torch's default collate, with the token ids right-padded to the batch's longest (the
    layout ``TaskTokenizer.encode_batch`` gives, so a batch is the same whether workers or the policy tokenized)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        samples = [dict(s) for s in samples]
        tokens = [s.pop(TOKENS) for s in samples]
        batch = torch.utils.data.default_collate(samples)
        batch[TOKENS], batch[TOKENS_MASK] = pad_token_ids([t.tolist() for t in tokens], self.pad_id)
        return batch
