"""The LIBERO adapter: LeRobot's observation conventions, official init states, reproducible episodes in any
process, success detected on a scripted episode, and `roboscale eval --env=libero` end to end."""

from __future__ import annotations

import multiprocessing as mp
import numpy as np
import pytest

pytest.importorskip("libero.libero", reason="LIBERO is installed by make install (roboscale[libero])")

from roboscale.configs.eval import EvalConfig  # noqa: E402
from roboscale.configs.rollout import RolloutConfig  # noqa: E402
from roboscale.errors import ConfigError  # noqa: E402
from roboscale.sim import libero, libero_suites  # noqa: E402
from roboscale.sim.env import env_spec, episode_seed  # noqa: E402
from roboscale.sim.experts import run_expert_episode  # noqa: E402
from roboscale.sim.libero_experts import EXPERTS  # noqa: E402

SOUP = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"
SOUP_WITH_MUG = "libero_object_with_mug/FLOOR_SCENE10_pick_the_alphabet_soup_and_place_it_in_the_basket"
SOUP_SWAPPED = f"libero_object_swap/{SOUP}"
SPEC = env_spec("libero")


@pytest.fixture(scope="module")
def env():
    with libero.LiberoEnv(SOUP, image_size=32, cameras=dict(libero.CAMERAS)) as env:
        yield env


def test_suites_and_task_names_resolve_with_their_episode_limits():
    assert len(SPEC.resolve_tasks(["libero_object"])) == 10 and len(SPEC.resolve_tasks("libero_90")) == 90
    assert SPEC.resolve_tasks([SOUP, "libero_object"])[0] == SOUP
    assert SPEC.instruction(SOUP) == "pick up the alphabet soup and place it in the basket"
    assert SPEC.tasks_or_default([]) == SPEC.resolve_tasks(["libero_object"])
    with pytest.raises(ConfigError, match="unknown LIBERO task 'pick_up_the_soup'"):
        SPEC.resolve_tasks(["pick_up_the_soup"])
    assert {s: libero_suites.task_info(SPEC.resolve_tasks([s])[0]).suite for s in libero_suites.SUITES} == {
        s: s for s in libero_suites.SUITES}
    assert libero_suites.EPISODE_LIMITS["libero_10"] == 520


def test_options_are_typed_and_checked():
    assert SPEC.parse_options({"settle_steps": "3"}).settle_steps == 3
    with pytest.raises(ConfigError, match=r"--env_options: unknown option\(s\) \['settle'\]"):
        SPEC.parse_options({"settle": 3})
    with pytest.raises(ConfigError, match="settle_steps must be >= 0"):
        SPEC.parse_options({"settle_steps": -1})
    with pytest.raises(ConfigError, match="takes no options"):
        env_spec("metaworld").parse_options({"settle_steps": 3})


def test_settling_past_robosuites_horizon_is_refused_naming_the_option():
    """``settle_steps=100000``: before, the episode ended while settling and the next step's error blamed the
    cameras (``executing action in terminated episode``)."""
    with pytest.raises(ConfigError, match=r"--env_options.settle_steps=100000 plus the episode's 280 steps exceed "
                                          r"robosuite's 1000 steps per reset .*at most 720"):
        libero.LiberoEnv(SOUP, image_size=32, options=libero.LiberoOptions(settle_steps=100_000))


def test_init_states_are_numeric_arrays_and_scene_picks_one(env, tmp_path):
    states = env.init_states
    assert states.shape[0] == libero.INIT_STATES_PER_TASK and states.dtype == np.float64
    env.options = libero.LiberoOptions(settle_steps=0)
    try:
        env.reset(seed=1, scene=57)  # scene mod 50
        np.testing.assert_allclose(env._env.get_sim_state(), states[7])
    finally:
        env.options = libero.LiberoOptions()
    pickled = tmp_path / "states.npz"
    np.savez(pickled, states=np.array([{"code": 1}], dtype=object))
    with pytest.raises(ConfigError, match="not a LIBERO init-state file"):
        libero.load_init_states(pickled)  # an object array would need unpickling: refused


def test_observations_follow_lerobots_conventions(env):
    observation = env.reset(seed=0, scene=0)
    raw = observation["privileged"]
    state = observation["state"]
    assert state.shape == (libero.STATE_DIM,) and state.dtype == np.float32
    np.testing.assert_allclose(state[:3], raw["robot0_eef_pos"], atol=1e-6)
    np.testing.assert_allclose(state[6:], raw["robot0_gripper_qpos"], atol=1e-6)
    x, y, z, w = raw["robot0_eef_quat"]
    angle = 2 * np.arccos(np.clip(w, -1, 1))  # robosuite's quat2axisangle, as LeRobot uses it
    assert np.linalg.norm(state[3:6]) == pytest.approx(angle, abs=1e-4)
    assert set(observation["images"]) == {"image", "image2"}
    assert all(image.shape == (32, 32, 3) and image.dtype == np.uint8 for image in observation["images"].values())


@pytest.mark.parametrize("task", [SOUP, SOUP_WITH_MUG])
def test_images_are_robosuites_frames_rotated_180_degrees(task):
    """LeRobot flips both axes of robosuite's own camera observation; ours must be that picture (up to the render
    settings we switch off: shadows, multisampling), and no other orientation of it; in LIBERO-Pro's scenes too."""
    from libero.libero.envs import OffScreenRenderEnv

    with libero.LiberoEnv(task, image_size=64, cameras=dict(libero.CAMERAS)) as ours:
        observation = ours.reset(seed=0, scene=3)
        theirs = OffScreenRenderEnv(bddl_file_name=str(ours.info.bddl_file), camera_heights=64, camera_widths=64)
        try:
            theirs.seed(0)
            theirs.reset()
            theirs.set_init_state(ours._env.get_sim_state())
            raw = theirs.env._get_observations(force_update=True)
        finally:
            theirs.close()
    for name, camera in (("image", "agentview_image"), ("image2", "robot0_eye_in_hand_image")):
        lerobot = raw[camera][::-1, ::-1].astype(int)
        image = observation["images"][name].astype(int)
        errors = {label: np.abs(view - lerobot).mean() for label, view in
                  {"as is": image, "flipped": image[::-1], "mirrored": image[:, ::-1],
                   "rotated": image[::-1, ::-1]}.items()}
        others = min(v for k, v in errors.items() if k != "as is")
        assert errors["as is"] < others / 2, (name, errors)


def _trajectory(seed: int, scene: int, before: tuple[int, int] | None = None, task: str = SOUP) -> np.ndarray:
    """The simulator's whole state (robot and objects) along an episode under fixed actions; ``before``: run
    another episode in the same env first."""
    with libero.LiberoEnv(task, image_size=16, cameras={}) as env:
        if before is not None:
            env.reset(*before)
            for _ in range(5):
                env.step(np.ones(7), render=False)
        env.reset(seed, scene)
        rng = np.random.default_rng(0)
        states = []
        for _ in range(15):
            env.step(rng.uniform(-1, 1, 7), render=False)
            states.append(env._env.get_sim_state())
    return np.stack(states)


@pytest.mark.parametrize("task", [SOUP, SOUP_SWAPPED])
def test_an_episode_is_the_same_in_a_fresh_env_a_reused_one_and_another_process(task):
    fresh = _trajectory(3, 4, task=task)
    reused = _trajectory(3, 4, before=(9, 11), task=task)
    with mp.get_context("spawn").Pool(1) as pool:
        elsewhere = pool.apply(_trajectory, (3, 4, None, task))
    np.testing.assert_array_equal(fresh, reused)
    np.testing.assert_array_equal(fresh, elsewhere)
    assert not np.array_equal(fresh, _trajectory(3, 5, task=task))  # another init state is another episode


def test_the_scripted_expert_succeeds_and_success_is_detected(env):
    episode = run_expert_episode(env, EXPERTS, episode_seed(0, SOUP, 0), 0.0, 0, scene=0)
    assert episode.success
    assert bool(episode.frames["next.success"][-1]) and not episode.frames["next.success"][:-1].any()
    assert episode.frames["observation.state"].shape[1] == libero.STATE_DIM
    assert episode.frames["action"].shape[1] == libero.ACTION_DIM


def test_eval_runs_libero_end_to_end(tmp_path):
    from roboscale.eval.closed_loop import evaluate
    from tests.sim.libero_helpers import tiny_libero_run

    tiny_libero_run(tmp_path / "run", [SPEC.instruction(SOUP)])
    cfg = EvalConfig(checkpoint=str(tmp_path / "run"), env="libero", env_options={"settle_steps": 2},
                     tasks=[SOUP], episodes=2, max_steps=6, videos_per_task=1, output_dir=str(tmp_path / "eval"),
                     rollout=RolloutConfig(workers=1, envs_per_worker=2))
    summary = evaluate(cfg, progress=False)
    assert summary["per_task"][SOUP]["episodes"] == 2
    protocol = (tmp_path / "eval" / "protocol.json").read_text()
    assert '"settle_steps": 2' in protocol and '"video_camera": "image"' in protocol
    assert list((tmp_path / "eval" / "videos").glob("*.mp4"))


def test_data_generate_writes_a_lerobot_dataset_of_libero_demonstrations(tmp_path):
    from roboscale.configs.data import GenerateConfig
    from roboscale.data import LeRobotDataset
    from roboscale.sim.experts import generate_dataset

    cfg = GenerateConfig(env="libero", tasks=[SOUP], episodes_per_task=1, out=str(tmp_path / "ds"), image_size=32,
                         workers=1, action_noise=0.05, steps_after_success=2, first_scene=25)
    generate_dataset(cfg)
    dataset = LeRobotDataset(root=tmp_path / "ds")
    assert dataset.num_episodes == 1 and dataset.meta.fps == libero.FPS
    assert dataset.meta.task_list == [SPEC.instruction(SOUP)]
    assert dataset.meta.info.robot_type == "panda"
    table = dataset.read_episode(0)
    assert bool(table["next.success"][-1]) and np.asarray(table["observation.state"]).shape[1] == libero.STATE_DIM
    item = dataset[0]
    assert item["observation.images.image"].shape == item["observation.images.image2"].shape == (3, 32, 32)
    assert item["action"].shape == (libero.ACTION_DIM,)
