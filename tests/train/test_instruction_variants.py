"""``--dataset.instruction_variants``: training reads other phrasings of the data's instructions."""

import json
from collections import Counter

import pytest

from roboscale.config import ConfigError
from roboscale.data.instructions import InstructionVariants
from roboscale.models.policy import Policy
from roboscale.train.supervised import train
from tests.conftest import TASKS
from tests.train.test_trainer import tiny_train_config

VARIANTS = {TASKS[0]: ["twist the faucet rightwards", "zorblax the tap"]}


def test_each_sample_reads_one_phrasing_drawn_from_its_own_seed_and_other_tasks_keep_theirs():
    seen = []
    variants = InstructionVariants(VARIANTS, then=lambda sample: seen.append(sample["task"]) or sample)
    chosen = [variants({"task": TASKS[0], "sample_seed": seed})["task"] for seed in range(600)]
    counts = Counter(chosen)
    assert set(counts) == {TASKS[0], *VARIANTS[TASKS[0]]}
    assert all(150 <= n <= 250 for n in counts.values()), counts  # uniform over the three: 200 each expected
    assert seen == chosen  # the policy's transform gets the phrasing
    # the same sample reads the same phrasing again (on any world size, after a resume): a function of its seed
    assert [variants({"task": TASKS[0], "sample_seed": seed})["task"] for seed in range(600)] == chosen
    assert {variants({"task": TASKS[1], "sample_seed": seed})["task"] for seed in range(50)} == {TASKS[1]}


def test_training_tokenizes_the_variants_and_hands_them_to_the_loader(tiny_dataset, tmp_path, monkeypatch):
    import roboscale.data.loading.loader as loader_module

    variants_file = tmp_path / "variants.json"
    variants_file.write_text(json.dumps(VARIANTS))
    transforms = []
    build = loader_module.build_loader

    def spy(source, config, **kw):
        transforms.append(kw["transform"])
        return build(source, config, **kw)

    monkeypatch.setattr(loader_module, "build_loader", spy)
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=2)
    cfg.dataset.instruction_variants = str(variants_file)
    final = train(cfg, progress=False)

    (transform,) = transforms
    policy = Policy.from_pretrained(final)
    assert isinstance(transform, InstructionVariants) and transform.variants == VARIANTS
    assert type(transform.then) is type(policy.data_transforms()[0])
    # a word only the variants have is one token of the trained tokenizer, as the data's own words are
    vocab = policy.tokenizer.backend.get_vocab()
    assert "Ġzorblax" in vocab and "Ġfaucet" in vocab
    assert json.loads((final / "train_config.json").read_text())["dataset"]["instruction_variants"] == str(
        variants_file)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "is not a JSON file"),
    ("[]", "must hold a non-empty JSON object"),
    (json.dumps({"Close the window": ["shut it"]}), "names the task 'Close the window', which the data does not have"),
    (json.dumps({TASKS[0]: "twist it"}), "must be a non-empty list of non-empty strings"),
    (json.dumps({TASKS[0]: ["twist it", ""]}), "must be a non-empty list of non-empty strings"),
])
def test_a_bad_variants_file_is_refused_before_training_naming_the_option_and_file(tiny_dataset, tmp_path,
                                                                                   content, message):
    variants_file = tmp_path / "variants.json"
    if content is not None:
        variants_file.write_text(content)
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=2)
    cfg.dataset.instruction_variants = str(variants_file)
    with pytest.raises(ConfigError, match=r"--dataset\.instruction_variants: .*variants\.json.*" + message):
        train(cfg, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_resume_refuses_a_variants_file_edited_since_the_checkpoint(tiny_dataset, tmp_path):
    from roboscale.errors import CheckpointError

    variants_file = tmp_path / "variants.json"
    variants_file.write_text(json.dumps(VARIANTS))

    def config(**kw):
        cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=4, **kw)
        cfg.dataset.instruction_variants = str(variants_file)
        return cfg

    train(config(save_freq=2), progress=False)
    resumable = config(resume=True)
    resumable.steps = 6
    variants_file.write_text(json.dumps({TASKS[0]: ["twist the faucet leftwards"]}))
    with pytest.raises(CheckpointError, match=r"instruction_variants_state\.json.*phrasings of "
                                              r"--dataset\.instruction_variants changed"):
        train(resumable, progress=False)
    variants_file.write_text(json.dumps(VARIANTS))  # the file restored: the run continues
    resumable = config(resume=True)
    resumable.steps = 6
    assert train(resumable, progress=False).parent.name == "000006"
