"""The rollout engine's ``EnvSetup`` for a policy: environments that show it what it was trained on (its cameras at
its image size, the state feature it reads, the adapter's options), checked in one environment before any worker
starts. What evaluation, RL and the benchmarks build their engines with."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from roboscale.errors import ConfigError
from roboscale.rollout.engine import EnvSetup
from roboscale.sim.env import EnvRequest, EnvSpec, env_spec

if TYPE_CHECKING:
    from roboscale.models.config import PolicyConfig


def policy_env_request(spec: EnvSpec, policy_cfg: PolicyConfig, checkpoint: Path, max_steps: int,
                       video_camera: str = "", options: dict[str, Any] | None = None) -> EnvRequest:
    """The ``EnvRequest`` for environments that show this policy what it was trained on: its cameras (and the
    video camera) at its image size, the state feature it reads, the adapter's own ``options`` parsed; one line
    when the env cannot give it."""
    names = [k.removeprefix("observation.images.") for k in policy_cfg.image_keys]
    cameras = spec.sim_cameras(dict.fromkeys([*names, video_camera] if video_camera else names))
    if policy_cfg.state_key not in spec.state_features:
        raise ConfigError(f"{checkpoint}: the policy reads the state feature {policy_cfg.state_key!r}, which the "
                          f"{spec.name} environment does not give (it gives {list(spec.state_features)})")
    return EnvRequest(image_size=int(getattr(policy_cfg, "image_size", 64)), cameras=cameras, max_steps=max_steps,
                      state_feature=policy_cfg.state_key, options=spec.parse_options(options or {}))


def policy_env_setup(env: str, tasks: list[str], policy_cfg: PolicyConfig, checkpoint: Path, max_steps: int,
                     env_options: dict[str, Any] | None = None) -> EnvSetup:
    """The rollout engine's ``EnvSetup`` for this policy in ``env`` (the name the user gave, which the workers
    resolve again: an adapter's own ``name`` need not be resolvable), no videos, its cameras checked in one
    environment."""
    spec = env_spec(env)
    request = policy_env_request(spec, policy_cfg, checkpoint, max_steps, options=env_options)
    check_cameras(spec, tasks[0], request, checkpoint)
    return EnvSetup(env, str(checkpoint), policy_cfg.n_action_steps, request)


def check_cameras(spec: EnvSpec, task: str, request: EnvRequest, checkpoint: Path) -> None:
    """One environment built and reset here: a camera the simulator lacks fails now, naming the checkpoint."""
    try:
        env = spec.make(task, request)
        try:
            env.reset(0)
        finally:
            env.close()
    except Exception as exc:
        raise ConfigError(f"{checkpoint}: the policy's cameras {sorted(request.cameras)} cannot be "
                          f"rendered by the {spec.name} environment ({type(exc).__name__}: {exc})") from None
