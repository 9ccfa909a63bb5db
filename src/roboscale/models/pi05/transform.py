"""pi0.5's per-sample preprocessing, run in the loader's workers: normalization (from the policy's statistics) and
tokenization -> ``TokenizedSample`` (``roboscale.models.pi05.layout``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from roboscale.models.normalize import Normalizer
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.pi05.layout import TokenizedSample
from roboscale.models.tokenizer import TaskTokenizer
from roboscale.utils.images import resize_with_pad

STATE_BINS = 256
_STATE_EDGES = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]


class Pi05Transform:
    """Per-sample preprocessing the loader's workers run: normalization (from the policy's statistics) and
    tokenization -> ``TokenizedSample``. Picklable (plain tensors and a ``tokenizers`` tokenizer).

    Accepts a LeRobot-style sample (one key per camera, ``observation.state``, ``action``, ``action_is_pad``,
    ``task``; a camera key that is absent, or False in an optional ``image_mask``, is an empty slot) or the design's
    Sample (``images`` [n_cam, 3, H, W] + ``image_mask``, ``state``, ``actions``, ``actions_is_pad``, ``task`` or
    ``tokens``).
    """

    def __init__(self, cfg: Pi05Config, state_normalizer: Normalizer, action_normalizer: Normalizer,
                 tokenizer: TaskTokenizer | None):
        self.image_keys = list(cfg.image_keys)
        self.image_size = cfg.image_size
        self.state_key, self.action_key = cfg.state_key, cfg.action_key
        self.max_language_tokens = cfg.max_language_tokens
        self.state_input = cfg.state_input
        self.prompt_state_padded = cfg.prompt_state_padded
        self.empty_missing_cameras = cfg.missing_cameras == "empty"
        self.state_width = cfg.dataset_state_dim or cfg.state_dim  # the dataset's (the state may be zero-padded)
        self.state_normalizer = state_normalizer.snapshot()
        self.action_normalizer = action_normalizer.snapshot()
        self.tokenizer = tokenizer

    def _tokens(self, task: str, normalized_state: torch.Tensor) -> torch.Tensor:
        if self.tokenizer is None:
            raise RuntimeError("this policy has no tokenizer; pass pre-tokenized observation.language.tokens")
        if self.state_input == "prompt":  # the prompt carries the state: a new string every frame
            # openpi tokenizes the state before padding it; LeRobot pads it first (prompt_state_padded)
            prompt = state_prompt(task, normalized_state if self.prompt_state_padded
                                  else normalized_state[: self.state_width])
            ids = self.tokenizer.encode(prompt, clean=False)[: self.max_language_tokens]
            return torch.tensor(ids, dtype=torch.long)
        return self.tokenizer.task_ids(task, self.max_language_tokens)

    def _images(self, sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "images" in sample:
            images = torch.as_tensor(sample["images"])
            mask = torch.as_tensor(sample.get("image_mask", torch.ones(images.shape[0], dtype=torch.bool))).bool()
            return images, mask
        # cameras may differ in size (a wrist camera smaller than the scene's): fit each before stacking them
        present = {k: resize_with_pad(torch.as_tensor(sample[k]), self.image_size) for k in self.image_keys
                   if k in sample}
        if not present:
            raise KeyError(f"sample has none of the cameras this policy reads: {self.image_keys}")
        blank = torch.zeros_like(next(iter(present.values())))
        images = torch.stack([present.get(k, blank) for k in self.image_keys])
        mask = torch.tensor([k in sample for k in self.image_keys], dtype=torch.bool)
        if "image_mask" in sample:
            mask &= torch.as_tensor(sample["image_mask"]).bool()
        return images, mask

    def __call__(self, sample: dict[str, Any]) -> TokenizedSample:
        images, image_mask = self._images(sample)
        state = torch.as_tensor(sample.get("state", sample.get(self.state_key))).float()
        state = self.state_normalizer.normalize(state)
        actions = sample.get("actions", sample.get(self.action_key))
        is_pad = sample.get("actions_is_pad", sample.get(f"{self.action_key}_is_pad"))
        if actions is not None:
            actions = self.action_normalizer.normalize(torch.as_tensor(actions).float())
            is_pad = torch.zeros(actions.shape[0], dtype=torch.bool) if is_pad is None else torch.as_tensor(is_pad)
            is_pad = is_pad.bool()
        if "tokens" in sample:
            tokens = torch.as_tensor(sample["tokens"]).long()[: self.max_language_tokens]
        elif "observation.language.tokens" in sample:
            ids = torch.as_tensor(sample["observation.language.tokens"]).long()
            mask = torch.as_tensor(sample["observation.language.attention_mask"]).bool()
            tokens = ids[mask][: self.max_language_tokens]
        else:
            tokens = self._tokens(sample["task"], state)
        return TokenizedSample(
            images=images,
            image_mask=image_mask,
            state=state,
            tokens=tokens,
            actions=actions,
            actions_is_pad=is_pad,
            episode_index=int(sample.get("episode_index", -1)),
            frame_index=int(sample.get("frame_index", -1)),
            sample_seed=int(sample.get("sample_seed", -1)),
        )

    def from_batch(self, batch: dict[str, Any]) -> list[TokenizedSample]:
        """A LeRobot-style *batch* dict (what eval and the in-memory loader give) -> samples. A camera the policy
        reads that is absent from the whole batch is an error, not an empty slot."""
        missing = [k for k in self.image_keys if k not in batch]
        if missing and not self.empty_missing_cameras:
            raise KeyError(
                f"observation has no {missing[0]!r}; this policy reads cameras {self.image_keys} (a camera missing "
                "from a whole batch is a configuration error: set policy.image_keys to the cameras the data has, "
                "or policy.missing_cameras=empty to feed it as an empty slot)"
            )
        if len(missing) == len(self.image_keys):
            raise KeyError(f"observation has none of the cameras this policy reads: {self.image_keys}")
        state = self.state_normalizer.normalize(torch.as_tensor(batch[self.state_key]).float().cpu())
        b = state.shape[0]
        tasks = batch.get("task")
        tasks = [tasks] * b if isinstance(tasks, str) else tasks
        # Normalize the whole batch at once, then cut it into samples (views): per-sample calls cost Python time.
        actions, is_pad = batch.get(self.action_key), batch.get(f"{self.action_key}_is_pad")
        if actions is not None:
            actions = self.action_normalizer.normalize(torch.as_tensor(actions).float().cpu())
            is_pad = torch.zeros(actions.shape[:2], dtype=torch.bool) if is_pad is None else torch.as_tensor(is_pad)
            is_pad = is_pad.bool().cpu()
        present = {k: resize_with_pad(torch.as_tensor(batch[k]).cpu(), self.image_size) for k in self.image_keys
                   if k in batch}
        blank = torch.zeros_like(next(iter(present.values())))  # an empty slot: masked, never encoded
        images = torch.stack([present.get(k, blank) for k in self.image_keys], dim=1)
        image_mask = batch.get("image_mask")
        if image_mask is None:
            image_mask = torch.ones(images.shape[:2], dtype=torch.bool)
        image_mask = torch.as_tensor(image_mask).bool().cpu() & torch.tensor([k in batch for k in self.image_keys])
        if "observation.language.tokens" in batch:
            ids = torch.as_tensor(batch["observation.language.tokens"]).long().cpu()
            lang_mask = torch.as_tensor(batch["observation.language.attention_mask"]).bool().cpu()
            tokens = [ids[i][lang_mask[i]][: self.max_language_tokens] for i in range(b)]
        else:
            if tasks is None:
                raise KeyError("batch has neither 'task' strings nor observation.language.tokens")
            tokens = [self._tokens(tasks[i], state[i]) for i in range(b)]
        episode = batch.get("episode_index")
        frame = batch.get("frame_index")
        seed = batch.get("sample_seed")
        return [
            TokenizedSample(
                images=images[i],
                image_mask=image_mask[i],
                state=state[i],
                tokens=tokens[i],
                actions=None if actions is None else actions[i],
                actions_is_pad=None if actions is None else is_pad[i],
                episode_index=int(episode[i]) if isinstance(episode, torch.Tensor) else -1,
                frame_index=int(frame[i]) if isinstance(frame, torch.Tensor) else -1,
                sample_seed=int(seed[i]) if isinstance(seed, torch.Tensor) else -1,
            )
            for i in range(b)
        ]


def state_prompt(task: str, normalized_state: torch.Tensor) -> str:
    """pi0.5's prompt, as openpi's ``PaligemmaTokenizer`` and LeRobot's ``Pi05PrepareStateTokenizerProcessorStep``
    write it: the task stripped, underscores and newlines made spaces (nothing else: runs of spaces stay), and the
    state (normalized to [-1, 1]) digitized into 256 bins, ``np.digitize(x, linspace(-1, 1, 257)[:-1]) - 1``, with
    no clamp: a value below -1 is bin -1, one at or above 1 - 2/256 bin 255."""
    # float32 values against float64 edges, as both do (torch's float32 edges would move a value on an edge)
    bins = np.digitize(normalized_state.detach().cpu().float().numpy(), _STATE_EDGES) - 1
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "
