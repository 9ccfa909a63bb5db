"""Fine-tuning from a pretrained checkpoint (``--policy.pretrained_path``, roboscale.models.finetune): the
checkpoint's architecture, weights and tokenizer; the training dataset's statistics, widths (zero-padded up to the
checkpoint's padded sizes, predictions cropped back) and cameras (on the checkpoint's image slots)."""

import dataclasses

import numpy as np
import pytest
import torch

from roboscale.config import from_dict, to_dict
from roboscale.data import LeRobotDataset
from roboscale.data.loading.meta import source_meta
from roboscale.data.loading.source import open_source
from roboscale.errors import ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.models.finetune import policy_for_finetuning
from roboscale.models.objective import flow_matching_loss
from roboscale.models.groot.config import GrootConfig
from roboscale.models.normalize import Normalizer
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.pi05.transform import state_prompt
from roboscale.models.policy import Policy
from roboscale.models.registry import GROOT_PRESETS, build_policy, fit_to_dataset
from tests.models.helpers import TASKS, fake_meta, tiny_config

CONFIGS = {"pi05": Pi05Config, "groot": GrootConfig}
STATS = {"pi05": ("q01", "q99"), "groot": ("min", "max")}  # what each policy's default normalization reads
STATE, ACTION = 8, 6  # the checkpoint's (padded) sizes; the tiny dataset has 4 and 4


def tiny(kind: str, **overrides):
    if kind == "pi05":
        return tiny_config(**overrides)
    return GrootConfig(**{**GROOT_PRESETS["tiny"], **overrides})


def checkpoint_meta(cameras=("observation.images.corner2", "observation.images.wrist")):
    """A dataset description with wider state/action and statistics unlike the tiny dataset's."""
    meta = fake_meta(state_dim=STATE, action_dim=ACTION)
    meta.stats = {k: {s: 3.0 * np.asarray(v) for s, v in stats.items()} for k, stats in meta.stats.items()}
    meta.features.update({k: {"dtype": "video", "shape": [32, 32, 3]} for k in cameras})
    meta.camera_keys = list(cameras)
    meta.task_list = TASKS + ["Rotate the faucet clockwise", "Open a drawer"]
    return meta


def save_checkpoint(kind, directory, cameras=("observation.images.corner2", "observation.images.wrist"),
                    **overrides):
    torch.manual_seed(0)
    policy = build_policy(tiny(kind, **overrides), checkpoint_meta(cameras))
    policy.save_pretrained(directory)
    return policy


@pytest.fixture(scope="module")
def meta(tiny_dataset):
    return source_meta([open_source(tiny_dataset)], [str(tiny_dataset)])


def dataset_samples(root, policy, frames=(0, 7, 31, 64)):
    ds = LeRobotDataset(root=root, delta_timestamps={"action": [i / 80 for i in range(policy.config.chunk_size)]},
                        return_uint8=True)
    return [ds[i] for i in frames]


def collated(policy, samples):
    """A training batch as the loader's workers make it: the policy's transform per sample, then its collate."""
    transform, collate = policy.data_transforms()
    return collate([transform(dict(s)) for s in samples])


def is_normalizer(name: str) -> bool:
    return name.startswith(("state_normalizer.", "action_normalizer."))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_checkpoint_is_fine_tuned_on_a_narrower_dataset(kind, tmp_path, tiny_dataset, meta):
    base = save_checkpoint(kind, tmp_path / "base")
    cfg = CONFIGS[kind](pretrained_path=str(tmp_path / "base"))  # every other option at its default
    policy = policy_for_finetuning(cfg, meta)

    # the checkpoint's architecture and weights (options not given are the checkpoint's, not the defaults)
    assert policy.config is cfg and type(policy) is type(base)
    assert to_dict(dataclasses.replace(cfg, pretrained_path=None, dataset_state_dim=0, dataset_action_dim=0)) == \
        to_dict(base.config)
    assert (cfg.state_dim, cfg.action_dim, cfg.dataset_state_dim, cfg.dataset_action_dim) == (STATE, ACTION, 4, 4)
    theirs = base.state_dict()
    ours = policy.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        if not is_normalizer(name):
            torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)
    assert policy.tokenizer.vocab_size == base.tokenizer.vocab_size

    # the dataset's statistics, padded with the identity's (a padded 0 stays 0)
    low, high = STATS[kind]
    for normalizer, key, width in ((policy.state_normalizer, "observation.state", STATE),
                                   (policy.action_normalizer, "action", ACTION)):
        stats = normalizer.stats()
        expected = torch.as_tensor(meta.stats[key][low], dtype=torch.float32).reshape(-1)
        torch.testing.assert_close(stats[low][:4], expected)
        assert stats[low].shape == (width,) and stats[low][4:].eq(-1).all() and stats[high][4:].eq(1).all()

    # training on the dataset's batches: padded to the checkpoint's sizes, a finite loss, gradients
    samples = dataset_samples(tiny_dataset, policy)
    batch = collated(policy, samples)
    loss, _ = flow_matching_loss(policy, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    encoded = policy.encode(batch)
    assert encoded.actions.shape == (4, cfg.chunk_size, ACTION) and encoded.actions[..., 4:].eq(0).all()

    # inference: actions of the dataset's width, and the saved fine-tuned policy predicts the same
    policy.eval()
    observation = torch.utils.data.default_collate(samples)
    torch.manual_seed(5)
    actions = policy.predict_action_chunk(observation)
    assert actions.shape == (4, cfg.chunk_size, 4)
    policy.save_pretrained(tmp_path / "tuned")
    reloaded = Policy.from_pretrained(tmp_path / "tuned").eval()
    assert to_dict(reloaded.config) == to_dict(cfg)
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    torch.manual_seed(5)
    torch.testing.assert_close(reloaded.predict_action_chunk(observation), actions, rtol=0, atol=0)

    # a resumed run checks the saved config against the data, and the config round-trips
    fit_to_dataset(reloaded.config, meta)
    assert to_dict(from_dict(PolicyConfig, to_dict(cfg))) == to_dict(cfg)


def test_options_that_keep_the_architecture_may_change_the_others_are_refused(tmp_path, meta):
    save_checkpoint("pi05", tmp_path / "base")
    path = str(tmp_path / "base")
    cfg = Pi05Config(pretrained_path=path, num_inference_steps=7, attention_backend="dense", packing=True,
                     n_action_steps=2, state_norm="mean_std")
    policy = policy_for_finetuning(cfg, meta)
    assert (cfg.num_inference_steps, cfg.attention_backend, cfg.packing, cfg.n_action_steps) == (7, "dense", True, 2)
    assert cfg.width == 48 and cfg.depth == 2  # the checkpoint's, not the defaults (256, 3)
    assert policy.state_normalizer.mode.value == "mean_std"
    torch.testing.assert_close(policy.state_normalizer.mean[:4],
                               torch.as_tensor(meta.stats["observation.state"]["mean"], dtype=torch.float32))

    with pytest.raises(ConfigError, match=r"--policy\.width=128 \(checkpoint: 48\), --policy\.state_input=\"prompt\" "
                                          r"\(checkpoint: \"token\"\) contradict"):
        policy_for_finetuning(Pi05Config(pretrained_path=path, width=128, state_input="prompt"), meta)
    with pytest.raises(ConfigError, match=r"--policy\.state_dim=4 \(checkpoint: 8\)"):
        policy_for_finetuning(Pi05Config(pretrained_path=path, state_dim=4), meta)
    with pytest.raises(ConfigError, match="tokenizer_path.*brings its tokenizer"):
        policy_for_finetuning(Pi05Config(pretrained_path=path, tokenizer_path="/tok.json"), meta)
    with pytest.raises(ConfigError, match=r"'pi05' policy.*--policy\.type=pi05"):
        policy_for_finetuning(GrootConfig(pretrained_path=path), meta)


def test_a_dataset_wider_than_the_checkpoint_is_refused(tmp_path, meta):
    save_checkpoint("groot", tmp_path / "base")
    cfg = GrootConfig(pretrained_path=str(tmp_path / "base"), state_key="observation.environment_state")
    with pytest.raises(ConfigError, match=r"'observation.environment_state' of the dataset at .* has 39 values, more "
                                          r"than the 8 of the checkpoint \(policy.state_dim\) at "
                                          r"--policy.pretrained_path="):
        policy_for_finetuning(cfg, meta)


def test_cameras_take_the_checkpoints_image_slots(tmp_path, tiny_dataset, meta):
    # three slots; the dataset's two cameras: "wrist" takes the slot of its name, "corner2" the first free one
    slots = ("observation.images.wrist", "observation.images.base", "observation.images.right")
    save_checkpoint("pi05", tmp_path / "three", cameras=slots)
    policy = policy_for_finetuning(Pi05Config(pretrained_path=str(tmp_path / "three")), meta)
    assert policy.config.image_keys == ["observation.images.wrist", "observation.images.corner2"]
    loss, _ = flow_matching_loss(policy, collated(policy, dataset_samples(tiny_dataset, policy)))
    assert torch.isfinite(loss)
    # --policy.image_keys picks the dataset's cameras
    policy = policy_for_finetuning(Pi05Config(pretrained_path=str(tmp_path / "three"),
                                              image_keys=["observation.images.corner2"]), meta)
    assert policy.config.image_keys == ["observation.images.corner2"]
    # more cameras than slots
    save_checkpoint("groot", tmp_path / "one", cameras=("observation.images.corner2",))
    with pytest.raises(ConfigError, match=r"2 cameras .* has 1 image slots .* --policy\.image_keys"):
        policy_for_finetuning(GrootConfig(pretrained_path=str(tmp_path / "one")), meta)


def test_a_lerobot_pi05_checkpoint_is_fine_tuned(tiny_dataset, meta, monkeypatch):
    """The checkpoint LeRobot 0.4.4 saved (tests/fixtures/lerobot-pi05-tiny) on a dataset narrower than it (4 of its
    8 state and 7 action values, cameras of other names): LeRobot's weights, the dataset's widths and statistics,
    LeRobot's prompt (the state zero-padded to 32 before it is digitized) and loss (over the dataset's dimensions)."""
    from tests.oracles.lerobot_oracle import FIXTURE, use_sizes

    use_sizes(monkeypatch)
    base = Policy.from_pretrained(FIXTURE / "pretrained_model", tokenizer_path=FIXTURE / "tokenizer.json")
    policy = policy_for_finetuning(Pi05Config(pretrained_path=str(FIXTURE / "pretrained_model"), n_action_steps=5,
                                              tokenizer_path=str(FIXTURE / "tokenizer.json")), meta)
    cfg = policy.config
    assert (cfg.n_action_steps, cfg.dataset_state_dim, cfg.dataset_action_dim) == (5, 4, 4)
    assert cfg.image_keys == ["observation.images.corner2", "observation.images.wrist"]  # on LeRobot's two slots
    for name, value in base.state_dict().items():
        if not is_normalizer(name):
            torch.testing.assert_close(policy.state_dict()[name], value, rtol=0, atol=0, msg=name)
    transform, _ = policy.data_transforms()
    raw = dataset_samples(tiny_dataset, policy, frames=(3,))[0]
    sample = transform(dict(raw))
    assert sample.state.shape == (32,) and sample.state[4:].eq(0).all()
    prompt = state_prompt(raw["task"], sample.state)  # all 32 values, as LeRobot's processor writes them
    assert prompt.count(" 128") >= 28
    assert sample.tokens.tolist() == policy.tokenizer.encode(prompt, clean=False)[: cfg.max_language_tokens]
    loss, _ = flow_matching_loss(policy, collated(policy, dataset_samples(tiny_dataset, policy)))
    assert torch.isfinite(loss)
    assert cfg.loss_action_width() == 4
    cfg.loss_action_dims = "all"  # openpi's choice, for a user who gives it
    assert cfg.loss_action_width() == 32


def test_a_wider_normalizer_pads_its_inputs_and_crops_its_outputs():
    normalizer = Normalizer(5, "quantiles", data_dim=3)
    normalizer.set_stats({"q01": [0.0, 0.0, 0.0], "q99": [2.0, 4.0, 8.0]})
    x = torch.tensor([[1.0, 2.0, 4.0]])
    normalized = normalizer.normalize(x)
    torch.testing.assert_close(normalized, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(normalizer.unnormalize(normalized), x)
    torch.testing.assert_close(normalizer.snapshot().normalize(x), normalized)
    with pytest.raises(ValueError, match="q01 has 4 values, the policy expects 3"):
        normalizer.set_stats({"q01": [0.0] * 4, "q99": [1.0] * 4}, "action")
