import pytest

from roboscale.config import ConfigError, field_docs, help_text, parse, to_dict
from roboscale.configs.train import TrainConfig
from roboscale.models.pi05.config import Pi05Config


def test_dotted_overrides_are_typed_and_nested():
    cfg = parse(TrainConfig, ["--steps=10", "--optimizer.lr", "1e-3", "--policy.width=64", "--dataset.episodes=[0,2]"])
    assert cfg.steps == 10 and cfg.optimizer.lr == 1e-3
    assert isinstance(cfg.policy, Pi05Config) and cfg.policy.width == 64
    assert cfg.dataset.episodes == [0, 2]


def test_yaml_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 5\noptimizer:\n  lr: 0.5\npolicy:\n  type: pi05\n  depth: 2\n")
    cfg = parse(TrainConfig, ["--config", str(path), "--steps=7"])
    assert cfg.steps == 7 and cfg.optimizer.lr == 0.5 and cfg.policy.depth == 2
    # And the saved form reads back to the same config.
    assert to_dict(parse(TrainConfig, [], defaults=cfg)) == to_dict(cfg)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stepz=3"], r"unknown option\(s\) \['stepz'\]"),
        (["--steps=three"], r"steps: cannot read 'three' as int"),
        (["--policy.type=nope"], r"policy.type: 'nope' is not one of \[.*'pi05'\]"),
        (["--resume=maybe"], r"resume: expected true/false"),
        (["--config=/does/not/exist.yaml"], r"--config: /does/not/exist.yaml does not exist"),
        (["--ray.placement_strategy=spread"], r"--ray.placement_strategy must be one of PACK, SPREAD, "),
    ],
)
def test_bad_options_give_one_clear_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(TrainConfig, argv)


def test_help_explains_every_option():
    text = help_text(TrainConfig, "roboscale train")
    docs = field_docs(Pi05Config)
    assert "--optimizer.lr" in text and "Peak learning rate" in text
    assert "--policy.type  one of ['groot', 'pi05']" in text
    for name in ("width", "chunk_size", "image_keys"):
        assert f"--policy.{name}" in text
        assert docs[name] in text


def test_help_lists_the_options_of_the_chosen_policy_type(capsys):
    with pytest.raises(SystemExit):
        parse(TrainConfig, ["--policy.type=groot", "--help"])
    groot = capsys.readouterr().out
    assert "--policy.dit_layers" in groot and "--policy.expert_width" not in groot
    assert "[groot]" in groot
    with pytest.raises(SystemExit):
        parse(TrainConfig, ["--help"])
    assert "--policy.expert_width" in capsys.readouterr().out  # the default type, pi05


def test_positional_arguments_fill_the_named_fields():
    from roboscale.configs.data import ConvertConfig, ValidateConfig
    from roboscale.configs.lake import LakeConfig

    lake = parse(LakeConfig, ["a", "b", "--output", "o", "--no-validate", "--image-size", "0", "--repair", "c"],
                 positional=("sources",))
    assert (lake.sources, lake.output, lake.validate, lake.image_size, lake.repair) == (["a", "b", "c"], "o", False,
                                                                                          0, True)
    check = parse(ValidateConfig, ["--quick", "dir"], positional=("root",))  # a bare flag does not eat DIR
    assert (check.root, check.quick) == ("dir", True)
    assert parse(ValidateConfig, ["--quick", "false", "dir"], positional=("root",)).quick is False
    convert = parse(ConvertConfig, ["old", "new", "--video-files-size-in-mb=0.5"], positional=("src", "dst"))
    assert (convert.src, convert.dst, convert.video_files_size_in_mb) == ("old", "new", 0.5)
    with pytest.raises(ConfigError, match="takes SRC DST, got 1 arguments"):
        parse(ConvertConfig, ["old"], positional=("src", "dst"))
    with pytest.raises(ConfigError, match="unexpected argument 'stray'"):
        parse(TrainConfig, ["stray"])


def test_space_separated_values_make_a_list_and_dashes_are_accepted():
    from roboscale.configs.data import GenerateConfig

    cfg = parse(GenerateConfig, ["--tasks", "drawer-open", "drawer-close", "--episodes-per-task", "3"])
    assert cfg.tasks == ["drawer-open", "drawer-close"] and cfg.episodes_per_task == 3
    assert parse(GenerateConfig, ["--tasks=mt10"]).tasks == ["mt10"]


def test_rollout_resources_are_parsed_and_need_a_ray_cluster():
    from roboscale.configs.eval import EvalConfig

    cfg = parse(EvalConfig, ["--rollout.ray_address=host0:6379", '--rollout.ray_resources={"sim": 1}'])
    assert cfg.rollout.ray_resources == {"sim": 1}
    with pytest.raises(ConfigError, match="--rollout.ray_resources places Ray tasks: give --rollout.ray_address"):
        parse(EvalConfig, ['--rollout.ray_resources={"sim": 1}'])
    with pytest.raises(ConfigError, match="each amount must be a positive number"):
        parse(EvalConfig, ["--rollout.ray_address=host0:6379", '--rollout.ray_resources={"sim": 0}'])
