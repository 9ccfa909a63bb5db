"""`roboscale eval`: score a checkpoint in closed loop and write a report that records the whole protocol.

Episode ``i`` of task ``t`` starts from ``reset(episode_seed(seed, t, i), scene=i)`` and draws its flow-matching noise
from (that seed, chunk index), so its outcome does not depend on the number of workers, environments per worker,
or the batch its observations were predicted in. Finished episodes go to ``episodes.jsonl`` as they finish; a
rerun with the same protocol skips them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from roboscale.config import to_dict
from roboscale.configs.eval import EvalConfig
from roboscale.errors import ConfigError
from roboscale.eval.records import read_json_object
from roboscale.models.policy import resolve_checkpoint
from roboscale.rollout.setup import check_cameras, policy_env_request
from roboscale.utils.io import atomic_write_json, exclusive_lock, sha256_file
from roboscale.utils.lifetime import interrupted

if TYPE_CHECKING:
    from roboscale.rollout.engine import RolloutStats

log = logging.getLogger(__name__)

PROTOCOL_FILE = "protocol.json"
LOCK_FILE = ".eval.lock"
PLACEMENT = ("episode i of task t starts from reset(seed=episode_seed(seed, t, i), scene=i), episode_seed a hash of "
             "(seed, t, i) (LIBERO: init state i mod 50): the same placement whichever worker runs it")
NOISE = ("flow-matching noise of the k-th chunk an episode predicts: N(0, 1) from PCG64([episode seed, k]): "
         "independent of batching")
SUCCESS_RULE = "success at any step ends the episode; no success within max_steps is a failure"
SCALARS = (int, float, str)
"""What a timing entry may be (the stats' counters of batch sizes are the engine's, not the report's)."""


def evaluate(cfg: EvalConfig, progress: bool = True, label: str = "") -> dict:
    from roboscale.eval.episode_log import EpisodeLog
    from roboscale.eval.report import write_report
    from roboscale.models.policy import Policy
    from roboscale.rollout.engine import EnvSetup, RolloutEngine
    from roboscale.rollout.episode import EpisodeJob
    from roboscale.sim.env import env_spec, episode_seed

    spec = env_spec(cfg.env)
    tasks = spec.tasks_or_default(cfg.tasks)
    variants = _robustness_variants(cfg, spec, tasks)
    tasks += [v["task"] for v in variants]
    instructions = {spec.resolve_tasks([t])[0]: text for t, text in cfg.instructions.items()}
    if cfg.rollout.server:  # the policy is served elsewhere: what it is comes from the server
        policy_cfg, policy_name, checkpoint, checkpoint_sha256 = _served_policy(cfg)
    elif not cfg.checkpoint:
        raise ConfigError("--checkpoint is required (a training output_dir, checkpoints/<step>, or pretrained_model)")
    elif cfg.policy.backend == "onnx":  # an exported directory: it names the weights it was exported from
        from roboscale.rollout.onnx import exported_policy

        checkpoint = Path(cfg.checkpoint).resolve()
        exported = exported_policy(checkpoint)
        policy_cfg, policy_name, checkpoint_sha256 = exported.config, exported.name, exported.weights_sha256
    else:
        checkpoint = resolve_checkpoint(cfg.checkpoint)
        policy = Policy.from_pretrained(checkpoint)  # a bad checkpoint fails here, at once, not in every worker
        policy_cfg, policy_name = policy.config, policy.name
        checkpoint_sha256 = sha256_file(checkpoint / "model.safetensors")
        del policy
    # an env without a camera of its own for videos shows the policy's first one
    video_camera = (cfg.video_camera or spec.video_camera
                    or next((k.removeprefix("observation.images.") for k in policy_cfg.image_keys), ""))
    request = policy_env_request(spec, policy_cfg, checkpoint, cfg.max_steps, video_camera, cfg.env_options)
    check_cameras(spec, tasks[0], request, checkpoint)
    out_dir = Path(cfg.output_dir) if cfg.output_dir else Path(checkpoint).parent / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)

    built = to_dict(request)  # what every environment is built with: cameras, image size, state, step limit, options
    built["env_options"] = built.pop("options")
    protocol = {
        "env": spec.name, "tasks": tasks, "episodes_per_task": cfg.episodes, "seed": cfg.seed,
        "placement": PLACEMENT, "success_rule": SUCCESS_RULE, **built,
        "video_camera": video_camera, "n_action_steps": policy_cfg.n_action_steps,
        "chunk_size": policy_cfg.chunk_size, "num_inference_steps": policy_cfg.num_inference_steps, "noise": NOISE,
        "instructions": {task: instructions.get(task) or spec.instruction(task) for task in tasks},
        "videos_per_task": cfg.videos_per_task,
    }
    if cfg.policy.backend != "torch":  # what ran the policy is part of what was measured (torch: as always)
        protocol["backend"] = cfg.policy.backend
    if variants:
        protocol["perturbations"] = list(dict.fromkeys(v["perturbation"] for v in variants))
    meta: dict[str, Any] = {
        "label": label, "checkpoint": str(checkpoint), "policy_type": policy_name,
        "checkpoint_sha256": checkpoint_sha256, "protocol": protocol,
    }
    if cfg.rollout.server:
        meta["server"] = cfg.rollout.server
    if variants:
        meta["variants"] = variants
    # one evaluation per directory: a second one would run every episode again into the same episodes.jsonl
    with exclusive_lock(out_dir / LOCK_FILE, lambda holder: ConfigError(
            f"{out_dir}: another evaluation ({holder}) is writing there; wait for it to end, or use another "
            "--output_dir")):
        episode_log = EpisodeLog(out_dir)
        done = _previous_episodes(out_dir, episode_log,
                                  {**protocol, "checkpoint_sha256": meta["checkpoint_sha256"]}, cfg.resume)
        candidates = 3 * cfg.videos_per_task  # videos are kept for failures and successes both: record a few more
        jobs = [
            EpisodeJob(task, i, episode_seed(cfg.seed, task, i), instructions.get(task, ""),
                       record_video=i < candidates)
            for task in tasks
            for i in range(cfg.episodes)
            if (task, i) not in done
        ]
        if done:
            log.info("resuming: %d of %d episodes were already done (%s)", len(done), len(tasks) * cfg.episodes,
                     episode_log.path)
        setup = EnvSetup(cfg.env, str(checkpoint), policy_cfg.n_action_steps, request, video_camera,
                         str(out_dir / "videos"), backend=cfg.policy.backend)
        results, stats = _run(RolloutEngine(cfg.rollout, setup), jobs, episode_log, progress)
        results = sorted([*done.values(), *results], key=lambda r: (tasks.index(r.task), r.episode))
        _select_videos(results, out_dir, cfg.videos_per_task)
        meta["timing"] = _timing(cfg, stats, len(jobs), len(done))
        meta["retries"] = [asdict(retry) for retry in stats.retries]
        summary = write_report(out_dir, results, tasks, meta)
        summary["report_dir"] = str(out_dir)
        summary["eval_seconds"] = stats.wall_s
        summary["timing"] = meta["timing"]
        return summary


def _robustness_variants(cfg: EvalConfig, spec: Any, tasks: list[str]) -> list[dict[str, Any]]:
    """With --robustness, the perturbed tasks of ``tasks`` (as dicts: they go to report.json)."""
    if not cfg.robustness:
        if cfg.perturbations:
            raise ConfigError("--perturbations picks the perturbations of --robustness=true, which is off")
        return []
    if spec.variants is None:
        raise ConfigError(f"--robustness: the {spec.name} environment has no perturbed tasks (libero has: "
                          "LIBERO-Pro's suites)")
    variants = [v._asdict() for v in spec.variants(tasks, list(cfg.perturbations))]
    if not variants:
        raise ConfigError(f"--robustness: no perturbation of --tasks={','.join(cfg.tasks)} is installed")
    return variants


def _served_policy(cfg: EvalConfig) -> tuple[Any, str, str, str]:
    """(policy config, policy type, checkpoint, its sha256) of the policy the server at ``--rollout.server`` serves,
    from the metadata it sends on connect; ConfigError when --output_dir is missing or --checkpoint disagrees."""
    from roboscale.config import from_dict
    from roboscale.models.config import PolicyConfig
    from roboscale.models.policy import read_policy_config
    from roboscale.models.registry import get_spec
    from roboscale.transport.websocket import connect, read_key

    if not cfg.output_dir:
        raise ConfigError("--output_dir is required with --rollout.server (the checkpoint is the server's)")
    ws, metadata = connect(cfg.rollout.server, read_key(cfg.rollout.server_api_key_file,
                                                        "--rollout.server_api_key_file"))
    ws.close()
    get_spec(metadata["policy"])  # a type this roboscale knows (the registry's import made each selectable)
    policy_cfg = from_dict(PolicyConfig, dict(metadata["policy_config"]), where=f"{cfg.rollout.server} metadata")
    if cfg.checkpoint:  # the same weights with another config (chunk size, steps) act differently too
        local_dir = resolve_checkpoint(cfg.checkpoint)
        local_cfg = from_dict(PolicyConfig, read_policy_config(local_dir), where=str(local_dir / "config.json"))
        differ = [what for what, same in (
            ("weights", sha256_file(local_dir / "model.safetensors") == metadata["checkpoint_sha256"]),
            ("configs", to_dict(local_cfg) == to_dict(policy_cfg))) if not same]
        if differ:
            raise ConfigError(f"--checkpoint={cfg.checkpoint} is not the policy {cfg.rollout.server} serves "
                              f"({metadata['checkpoint']}): their {' and '.join(differ)} differ")
    return policy_cfg, metadata["policy"], metadata["checkpoint"], metadata["checkpoint_sha256"]


def _timing(cfg: EvalConfig, stats: RolloutStats, run: int, resumed: int) -> dict[str, Any]:
    """Where the evaluation's time went (every measure of the engine's ``RolloutStats``: its numbers, and the
    servers' batching as ``batching.*``) and the settings it ran with (the rollout's layout, its
    ``RunnerConfig`` whole as ``runner.*``)."""
    rollout = cfg.rollout
    measured = {f.name: getattr(stats, f.name) for f in fields(stats) if isinstance(getattr(stats, f.name), SCALARS)}
    batching = {f"batching.{f.name}": getattr(stats.batching, f.name) for f in fields(stats.batching)
                if isinstance(getattr(stats.batching, f.name), SCALARS)} if stats.inference == "server" else {}
    return {
        **measured, "env_steps_per_s": stats.env_steps / stats.wall_s if stats.wall_s else 0.0,
        "mean_batch_size": stats.mean_batch_size, **batching,
        "workers": rollout.workers, "envs_per_worker": rollout.envs_per_worker,
        "servers": rollout.servers if stats.inference == "server" else 0,
        **{f"runner.{name}": value for name, value in to_dict(rollout.runner).items()},
        "episodes_run": run, "episodes_resumed": resumed,
    }


def _previous_episodes(out_dir: Path, episode_log: Any, protocol: dict, resume: bool) -> dict:
    """The episodes an interrupted run with the same protocol finished (none when ``resume`` is off)."""
    path = out_dir / PROTOCOL_FILE
    done = {}
    if resume and path.is_file():
        previous = read_json_object(path, "delete it, or --resume=false to start over")
        changed = sorted(k for k in protocol.keys() | previous.keys()
                         if k != "videos_per_task" and previous.get(k) != protocol.get(k))
        if changed:
            raise ConfigError(f"{out_dir} holds an evaluation with another protocol (differs in: "
                              f"{', '.join(changed)}); use another --output_dir, or --resume=false to start over")
        wanted = {(t, i) for t in protocol["tasks"] for i in range(protocol["episodes_per_task"])}
        done = {(r.task, r.episode): r for r in episode_log.read() if (r.task, r.episode) in wanted}
    else:
        episode_log.clear()
    atomic_write_json(path, protocol, indent=2)
    return done


def _run(engine: Any, jobs: list, episode_log: Any, progress: bool) -> tuple[list, Any]:
    from tqdm import tqdm

    finished: list = []
    with tqdm(total=len(jobs), desc="evaluating", unit="ep", disable=not progress) as bar:
        def on_result(result: Any) -> None:
            episode_log.append(result)
            finished.append(result.success)
            bar.update(1)
            bar.set_postfix(success=f"{np.mean(finished):.0%}")

        try:
            return engine.run(jobs, on_result)
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (utils.lifetime): what is kept, how to go on
            raise interrupted(exc, f"after {len(finished)} of {len(jobs)} episodes; the finished ones are kept in "
                                   f"{episode_log.path}: the same command runs the others") from None


def _select_videos(results: list, out_dir: Path, per_task: int) -> None:
    """Keep ``per_task`` videos per task, half of them failures where there are failures (the first episodes
    of each kind); delete the other recorded ones. Video paths become relative to the report directory."""
    videos = out_dir / "videos"
    by_task: dict[str, list] = {}
    for result in results:
        if result.video:
            by_task.setdefault(result.task, []).append(result)
    for recorded in by_task.values():
        failures = [r for r in recorded if not r.success]
        successes = [r for r in recorded if r.success]
        n_fail = min(len(failures), max(per_task // 2, per_task - len(successes)))
        keep = {id(r) for r in failures[:n_fail] + successes[: per_task - n_fail]}
        for result in recorded:
            name = Path(result.video).name
            if id(result) in keep and (videos / name).is_file():
                result.video = f"videos/{name}"
            else:
                (videos / name).unlink(missing_ok=True)
                result.video = None
