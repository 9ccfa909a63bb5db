import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from roboscale.config import ConfigError
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.policy import Policy
from roboscale.configs.train import DatasetConfig, OptimizerConfig, TrainConfig
from roboscale.train.supervised import train
from tests.conftest import TASKS


def tiny_train_config(root, out, steps, **kw) -> TrainConfig:
    policy = Pi05Config(image_size=32, vit_patch_size=8, vit_dim=32, vit_depth=1, vit_heads=2, width=48, depth=2,
                        num_heads=2, head_dim=16, mlp_dim=64, expert_width=32, expert_mlp_dim=48, chunk_size=8,
                        n_action_steps=4, num_inference_steps=3)
    return TrainConfig(dataset=DatasetConfig(root=str(root)), policy=policy, steps=steps, batch_size=16,
                       output_dir=str(out), save_freq=kw.pop("save_freq", 1000), log_freq=5,
                       optimizer=OptimizerConfig(lr=3e-3, warmup_steps=5), **kw)


def _losses(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [e.value for e in acc.Scalars("train/loss")]


def test_training_lowers_the_loss_and_writes_a_loadable_checkpoint(tiny_dataset, tmp_path):
    final = train(tiny_train_config(tiny_dataset, tmp_path / "run", steps=60), progress=False)
    losses = _losses(tmp_path / "run")
    assert losses[-1] < 0.6 * losses[0]
    assert final == (tmp_path / "run" / "checkpoints" / "000060" / "pretrained_model").resolve()
    assert (tmp_path / "run" / "checkpoints" / "last").resolve().name == "000060"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_config.json"):
        assert (final / name).is_file()
    policy = Policy.from_pretrained(final)
    assert policy.config.image_keys == ["observation.images.corner2", "observation.images.wrist"]
    assert json.loads((final.parent / "training_state" / "trainer_state.json").read_text())["step"] == 60


@pytest.mark.parametrize("workers, instruction_variants", [(0, False), (2, False), (2, True)])
def test_resume_continues_exactly(tiny_dataset, tmp_path, workers, instruction_variants):
    variants_file = tmp_path / "variants.json"  # with variants, their transform travels to the worker processes
    variants_file.write_text(json.dumps({TASKS[0]: ["twist the faucet rightwards", "zorblax the tap"]}))

    def config(out, **kw):
        cfg = tiny_train_config(tiny_dataset, out, steps=8, **kw)
        cfg.dataset.num_workers = workers
        cfg.dataset.instruction_variants = str(variants_file) if instruction_variants else ""
        return cfg

    straight = train(config(tmp_path / "a"), progress=False)
    train(config(tmp_path / "b", save_freq=4), progress=False)
    # Simulate a run killed after step 4: drop the final checkpoint and point `last` back to step 4.
    import shutil

    ckpts = tmp_path / "b" / "checkpoints"
    shutil.rmtree(ckpts / "000008")
    (ckpts / "last").unlink()
    (ckpts / "last").symlink_to("000004")
    resumed = train(config(tmp_path / "b", resume=True), progress=False)
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_background_checkpoint_writes_commit_the_same_state_and_resume_exactly(tiny_dataset, tmp_path):
    import shutil

    from roboscale.train.checkpoint import step_directories

    def config(out, asynchronous, **kw):
        cfg = tiny_train_config(tiny_dataset, out, steps=8, save_freq=2, **kw)
        cfg.checkpoint.keep_last = 0
        cfg.checkpoint.async_save = asynchronous
        return cfg

    straight = train(config(tmp_path / "sync", False), progress=False)
    background = train(config(tmp_path / "async", True), progress=False)
    checkpoints = tmp_path / "async" / "checkpoints"
    assert background == (checkpoints / "000008" / "pretrained_model").resolve()
    assert [p.name for p in step_directories(checkpoints)] == ["000002", "000004", "000006", "000008"]
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]  # no temporaries left
    for step in ("000002", "000008"):  # the state as it was at the save, not as training changed it after
        a = load_file(str(tmp_path / "sync" / "checkpoints" / step / "pretrained_model" / "model.safetensors"))
        b = load_file(str(checkpoints / step / "pretrained_model" / "model.safetensors"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    shutil.rmtree(checkpoints / "000006")  # a run killed after step 4's commit
    shutil.rmtree(checkpoints / "000008")
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to("000004")
    resumed = train(config(tmp_path / "async", True, resume=True), progress=False)
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(resumed / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert all("checkpoint_s" in row for row in rows)


def test_existing_output_dir_needs_resume_and_resume_needs_a_checkpoint(tiny_dataset, tmp_path):
    train(tiny_train_config(tiny_dataset, tmp_path / "run", steps=2), progress=False)
    with pytest.raises(ConfigError, match="already has checkpoints; pass --resume=true"):
        train(tiny_train_config(tiny_dataset, tmp_path / "run", steps=2), progress=False)
    with pytest.raises(ConfigError, match="no checkpoint under"):
        train(tiny_train_config(tiny_dataset, tmp_path / "fresh", steps=2, resume=True), progress=False)


def test_a_camera_missing_from_the_dataset_is_a_clear_error(tiny_dataset, tmp_path):
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=2)
    cfg.policy.image_keys = ["observation.images.top"]
    with pytest.raises(ValueError, match=r"cameras \['observation.images.top'\] are not in the dataset"):
        train(cfg, progress=False)


def test_training_logs_data_wait_and_hands_the_policys_data_transforms_to_the_loader(tiny_dataset, tmp_path,
                                                                                     monkeypatch):
    import roboscale.data.loading.loader as loader_module

    calls = []
    build = loader_module.build_loader

    def spy(source, config, **kw):
        calls.append({**kw, "config": config})
        return build(source, config, **kw)

    monkeypatch.setattr(loader_module, "build_loader", spy)
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=5)
    cfg.dataset.num_workers = 1
    train(cfg, progress=False)
    (kw,) = calls
    assert kw["config"].num_workers == 1 and kw["config"].batch_size == 16
    assert kw["keys"] == [*cfg.policy.image_keys, "observation.state", "action"]
    assert len(kw["delta_timestamps"]["action"]) == cfg.policy.chunk_size
    policy = Policy.from_pretrained(tmp_path / "run" / "checkpoints" / "last" / "pretrained_model")
    if hasattr(policy, "data_transforms"):  # worker-side normalization/tokenization/packing
        transform, collate = policy.data_transforms()
        assert type(kw["transform"]) is type(transform) and type(kw["collate"]) is type(collate)
    else:
        assert kw["transform"] is None and kw["collate"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    waits = [e.value for e in acc.Scalars("train/data_wait")]
    assert waits and all(0.0 <= w <= 1.0 for w in waits)
    assert [e.value for e in acc.Scalars("loader/batches")][-1] == 5
    tokens_per_s = [e.value for e in acc.Scalars("train/tokens_per_s")]
    samples_per_s = [e.value for e in acc.Scalars("train/samples_per_s")]
    # every sample brings at least its action chunk; the padded layout computes over some padding
    assert tokens_per_s and all(t >= cfg.policy.chunk_size * s for t, s in zip(tokens_per_s, samples_per_s))
    assert all(0.0 <= e.value < 1.0 for e in acc.Scalars("train/padding"))


def test_a_token_budget_trains_on_micro_batches_built_in_the_workers(tiny_dataset, tmp_path, monkeypatch):
    from roboscale.train.trainer import Trainer

    seen = []
    micro_batches = Trainer.micro_batches

    def spy(self, batch):
        seen.append(len(batch) if isinstance(batch, list) else 0)
        return micro_batches(self, batch)

    monkeypatch.setattr(Trainer, "micro_batches", spy)
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=5)
    cfg.policy.packing, cfg.policy.pack_token_budget = True, 100  # 16 samples of ~18 tokens: 3 micro-batches
    cfg.dataset.num_workers = 1  # lists of PackedBatches cross the worker boundary
    final = train(cfg, progress=False)
    assert len(seen) == 5 and min(seen) >= 2
    assert Policy.from_pretrained(final).config.pack_token_budget == 100
    assert all(torch.isfinite(torch.tensor(v)) for v in _losses(tmp_path / "run"))


def test_cli_skip_bad_episodes_flag_sets_the_dataset_option(monkeypatch, tmp_path):
    import roboscale.train.supervised as supervised
    from roboscale.cli import main

    seen = []
    monkeypatch.setattr(supervised, "train", lambda cfg: seen.append(cfg) or tmp_path)
    main(["train", "--skip-bad-episodes", "--dataset.num_workers=3"])
    assert seen[0].dataset.skip_bad_episodes is True and seen[0].dataset.num_workers == 3


@pytest.mark.parametrize("policy_type", ["pi05", "groot"])
def test_both_policies_train_on_cameras_of_different_sizes(tmp_path, policy_type):
    """LeRobot's own fixture has a 64x64 scene camera and a 48x64 wrist camera: each is fitted to the policy's
    square input (aspect kept by padding) before the cameras are stacked."""
    from roboscale.data import LeRobotDataset
    from roboscale.data.lerobot.format import image_hwc, read_info
    from roboscale.models.registry import preset_config

    fixture_root = Path(__file__).parent.parent / "fixtures" / "lerobot-v3.0-mini"

    sizes = {image_hwc(f)[:2] for k, f in read_info(fixture_root).features.items() if k.startswith("observation.im")}
    assert len(sizes) == 2  # the point of this test
    cfg = tiny_train_config(fixture_root, tmp_path / "run", steps=2)
    cfg.batch_size = 8
    if policy_type == "groot":
        cfg.policy = preset_config("groot", "tiny")
    final = train(cfg, progress=False)
    policy = Policy.from_pretrained(final)
    assert len(policy.config.image_keys) == 2
    batch = next(iter(torch.utils.data.DataLoader(LeRobotDataset(root=fixture_root), batch_size=2)))
    chunk = policy.eval().predict_action_chunk(batch)
    assert chunk.shape[0] == 2 and torch.isfinite(chunk).all()


def test_resume_refuses_options_that_contradict_the_checkpoint_and_honours_the_rest(tiny_dataset, tmp_path):
    from roboscale.train.resume import parse_train_args

    out = tmp_path / "run"
    train(tiny_train_config(tiny_dataset, out, steps=2), progress=False)
    resume = [f"--output_dir={out}", "--resume=true"]
    # options not given are the checkpoint's, so a bare resume changes nothing
    cfg = parse_train_args(resume)
    assert cfg.batch_size == 16 and cfg.policy.width == 48 and cfg.dataset.root == str(tiny_dataset)
    with pytest.raises(ConfigError, match=r"2 options differ .*--batch_size=8 \(checkpoint: 16\); "
                                          r"--policy.width=128 \(checkpoint: 48\)"):
        train(parse_train_args([*resume, "--policy.width=128", "--batch_size=8"]), progress=False)
    final = train(parse_train_args([*resume, "--steps=4", "--log_freq=1", "--save_freq=1"]), progress=False)
    assert final.parent.name == "000004"
    # a Python caller's config leaves dataset-derived policy fields at 0 / empty: those are not changes
    train(tiny_train_config(tiny_dataset, out, steps=5, resume=True), progress=False)
    # a checkpoint written before an option existed resumes with that option's default
    saved = out / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    older = json.loads(saved.read_text())
    del older["checkpoint"], older["policy"]["pack_token_budget"]
    saved.write_text(json.dumps(older))
    assert train(parse_train_args([*resume, "--steps=6"]), progress=False).parent.name == "000006"


def test_old_checkpoints_are_pruned_but_last_is_kept(tiny_dataset, tmp_path):
    from roboscale.train.checkpoint import prune_checkpoints, step_directories

    out = tmp_path / "run"
    cfg = tiny_train_config(tiny_dataset, out, steps=6, save_freq=1)
    cfg.checkpoint.keep_last = 2
    train(cfg, progress=False)
    checkpoints = out / "checkpoints"
    assert [p.name for p in step_directories(checkpoints)] == ["000005", "000006"]
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to("000005")  # e.g. a best checkpoint, or last after a rollback
    (checkpoints / "best").symlink_to("000005")
    resumed = tiny_train_config(tiny_dataset, out, steps=8, save_freq=1, resume=True)
    resumed.checkpoint.keep_last = 2
    train(resumed, progress=False)  # from step 5: writes 6, 7, 8
    assert [p.name for p in step_directories(checkpoints)] == ["000005", "000007", "000008"]
    assert prune_checkpoints(out, keep_last=1) == [checkpoints / "000007"]


def test_what_a_killed_save_left_is_removed_by_the_next_run_and_a_live_one_is_not(tiny_dataset, tmp_path):
    import subprocess
    import sys

    from roboscale.train.checkpoint import remove_stale_files
    from roboscale.utils.io import make_temporary_directory

    out = tmp_path / "run"
    train(tiny_train_config(tiny_dataset, out, steps=2), progress=False)
    checkpoints = out / "checkpoints"
    # a save killed half-way: its hidden temporary, held by nobody
    killed = subprocess.run([sys.executable, "-c", "import sys\nfrom roboscale.utils.io import "
                             "make_temporary_directory\ntmp, _ = make_temporary_directory(sys.argv[1])\n"
                             "(tmp / 'model.safetensors').write_bytes(b'x' * 1000)\nprint(tmp)",
                             str(checkpoints / "000003")], capture_output=True, text=True, check=True)
    abandoned = checkpoints / killed.stdout.strip().rsplit("/", 1)[-1]
    assert abandoned.is_dir() and abandoned.name.startswith(".000003.")
    live, lock = make_temporary_directory(checkpoints / "000004")  # a save in progress elsewhere
    try:
        assert remove_stale_files(out) == [abandoned]
        assert live.is_dir() and not abandoned.exists()
    finally:
        import os

        os.close(lock)
    assert remove_stale_files(out) == [live]


@pytest.mark.parametrize("option, message", [
    ("--steps=0", r"--steps must be a positive integer, got 0"),
    ("--batch_size=0", r"--batch_size must be a positive integer, got 0"),
    ("--checkpoint.keep_last=-1", r"checkpoint.keep_last must be >= 0"),
])
def test_nonsense_numbers_are_usage_errors(option, message, capsys):
    from roboscale.cli import main

    assert main(["train", option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(message, err)


def test_an_output_dir_that_is_a_file_or_read_only_is_refused_before_training(tiny_dataset, tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"--output_dir .*file: exists and is not a directory"):
        train(tiny_train_config(tiny_dataset, afile, steps=1), progress=False)
    # /proc refuses new directories to every user, root included (a chmod would not stop root)
    with pytest.raises(ConfigError, match=r"--output_dir /proc/roboscale/run: cannot write there"):
        train(tiny_train_config(tiny_dataset, "/proc/roboscale/run", steps=1), progress=False)


def test_a_second_training_into_the_same_output_dir_is_refused(tiny_dataset, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom pathlib import Path\nfrom roboscale.utils.io "
                               "import exclusive_lock\nwith exclusive_lock(Path(sys.argv[1]), RuntimeError):\n"
                               "    print('locked', flush=True); sys.stdin.read()", str(out / ".train.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"--output_dir {out}: another training \(pid {holder.pid} on "):
            train(tiny_train_config(tiny_dataset, out, steps=1), progress=False)
    finally:
        holder.kill()
        holder.wait()
    train(tiny_train_config(tiny_dataset, out, steps=1), progress=False)  # the kernel dropped the dead one's lock


def _poison(monkeypatch, steps: set[int] | None) -> None:
    """Make the objective's gradients NaN at the given optimizer steps (1-based; None: every step)."""
    from roboscale.train.trainer import Trainer

    build = Trainer.build

    def build_then_poison(self):
        build(self)
        objective = self.objective

        def poisoned(policy, batch):
            loss, metrics = objective(policy, batch)
            if steps is None or self.step + 1 in steps:
                loss = loss * float("nan")
            return loss, metrics

        self.objective = poisoned

    monkeypatch.setattr(Trainer, "build", build_then_poison)


def test_a_nonfinite_step_is_skipped_and_counted(tiny_dataset, tmp_path, monkeypatch):
    _poison(monkeypatch, {3})
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=6)
    cfg.log_freq = 1
    final = train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert all(torch.isfinite(t).all() for t in load_file(str(final / "model.safetensors")).values())


def test_nonfinite_steps_in_a_row_stop_the_run_naming_the_step(tiny_dataset, tmp_path, monkeypatch):
    from roboscale.errors import TrainingError

    _poison(monkeypatch, None)
    cfg = tiny_train_config(tiny_dataset, tmp_path / "run", steps=10)
    cfg.max_nonfinite_steps = 3
    with pytest.raises(TrainingError, match=r"^step 3: loss or gradient norm not finite in 3 steps in a row"):
        train(cfg, progress=False)


def test_fine_tuning_starts_from_the_pretrained_weights(tiny_dataset, tmp_path):
    pretrained = train(tiny_train_config(tiny_dataset, tmp_path / "pretrain", steps=40), progress=False)
    scratch = tiny_train_config(tiny_dataset, tmp_path / "scratch", steps=2)
    scratch.log_freq = 1
    train(scratch, progress=False)
    tuned = tiny_train_config(tiny_dataset, tmp_path / "tuned", steps=2)
    tuned.log_freq = 1
    tuned.policy.pretrained_path = str(pretrained)
    final = train(tuned, progress=False)
    first = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["loss"]
             for name in ("scratch", "tuned")}
    assert first["tuned"] < 0.7 * first["scratch"]
    assert Policy.from_pretrained(final).config.pretrained_path == str(pretrained)


def test_ema_weights_are_what_checkpoints_export_and_resume_continues_them(tiny_dataset, tmp_path):
    import shutil

    import torch.distributed.checkpoint as dcp

    def config(out, **kw):
        cfg = tiny_train_config(tiny_dataset, out, steps=6, **kw)
        cfg.ema_decay = 0.5
        return cfg

    final = train(config(tmp_path / "a"), progress=False)
    exported = load_file(str(final / "model.safetensors"))
    # the live weights (only in the sharded state) and the averaged ones (pretrained_model) differ after 6 steps
    parameters = dict(Policy.from_pretrained(final).named_parameters())
    state = {"model": {name: torch.zeros_like(p) for name, p in parameters.items()}}
    dcp.load(state, checkpoint_id=str(final.parent / "training_state" / "model_optimizer"), no_dist=True)
    assert sum(not torch.equal(state["model"][name], exported[name]) for name in parameters) > len(parameters) // 2
    # a resume restores the average too: the same end as the uninterrupted run
    train(config(tmp_path / "b", save_freq=3), progress=False)
    ckpts = tmp_path / "b" / "checkpoints"
    shutil.rmtree(ckpts / "000006")
    (ckpts / "last").unlink()
    (ckpts / "last").symlink_to("000003")
    resumed = train(config(tmp_path / "b", save_freq=3, resume=True), progress=False)
    for name, value in load_file(str(resumed / "model.safetensors")).items():
        assert torch.equal(value, exported[name]), name


def test_wandb_gets_the_logged_metrics_and_a_resumed_run_continues_its_wandb_run(tiny_dataset, tmp_path,
                                                                                 monkeypatch):
    import sys
    import types

    runs = []

    class FakeRun:  # what the trainer uses of a wandb Run
        def __init__(self, **kwargs):
            self.init = kwargs
            self.id = kwargs["id"] or f"run{len(runs)}"
            self.logged, self.finished = [], False

        def log(self, data, step=None):
            self.logged.append((step, dict(data)))

        def finish(self):
            self.finished = True

    def init(**kwargs):
        runs.append(FakeRun(**kwargs))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    out = tmp_path / "run"
    train(tiny_train_config(tiny_dataset, out, steps=10, save_freq=5, wandb=True), progress=False)
    first = runs[0]
    assert first.init["dir"] == str(out) and first.init["id"] is None and first.init["config"]["steps"] == 10
    assert [step for step, _ in first.logged] == [5, 10] and "loss" in first.logged[0][1] and first.finished
    assert (out / "wandb_run_id").read_text() == "run0"
    train(tiny_train_config(tiny_dataset, out, steps=15, save_freq=5, wandb=True, resume=True), progress=False)
    assert runs[1].init["id"] == "run0" and runs[1].init["resume"] == "allow"
    assert [step for step, _ in runs[1].logged] == [15]
