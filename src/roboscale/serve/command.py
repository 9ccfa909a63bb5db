"""`roboscale serve`: a checkpoint assembled into a ``PolicyServer`` (``serve.server``) and run.

The server serves a ``Predictor``, an ``ObservationLayout``, metadata and ``ServerOptions``; this is where they come
from: the options and the API key first (a key file that cannot be read, or an interface beyond loopback without
a key, fails before the checkpoint is even read), then the checkpoint resolved and loaded (a bad one fails here,
before the port is opened), its layout for the client's keys, and the metadata a client reads on connect (which
policy, its config, the weights' sha256, the device).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from roboscale.config import to_dict
from roboscale.configs.serve import ServeConfig
from roboscale.errors import ConfigError
from roboscale.models.policy import resolve_checkpoint
from roboscale.rollout.inference import RunnerSettings, inference_threads
from roboscale.serve.observation import ObservationLayout
from roboscale.serve.server import HEALTH_PATH, PolicyServer, ServerOptions
from roboscale.transport.websocket import read_key, require_websockets
from roboscale.transport.wire import WireLimits
from roboscale.utils.io import sha256_file


def server_options(cfg: ServeConfig) -> ServerOptions:
    """The server's part of the options; ConfigError for an unreadable key file or a key missing off loopback."""
    return ServerOptions(
        host=cfg.host, port=cfg.port, api_key=read_key(cfg.api_key_file, "--api_key_file") or None,
        max_message_bytes=int(cfg.max_message_mb * 2 ** 20),
        # a message's strings: the prompt (up to 4 UTF-8 bytes a character) and short keys
        limits=WireLimits(max_str_bytes=max(4 * cfg.max_prompt_chars, 1024),
                          option=f"--max_prompt_chars={cfg.max_prompt_chars}"),
        batching=cfg.runner, shutdown_grace_s=cfg.shutdown_grace_s)


def build_server(cfg: ServeConfig, on_ready: Callable[[str, int], None] | None = None) -> PolicyServer:
    """The server for ``cfg``, its policy loaded on the calling thread (call ``run`` on the same one: the model's
    thread pool belongs to the thread that first ran it); every bad option or checkpoint is a one-line error
    raised here, before the port is opened."""
    require_websockets("roboscale serve")
    if not cfg.checkpoint:
        raise ConfigError("--checkpoint is required (a training output_dir, checkpoints/<step>, or "
                          "pretrained_model)")
    options = server_options(cfg)
    onnx = cfg.backend == "onnx"
    checkpoint = Path(cfg.checkpoint).resolve() if onnx else resolve_checkpoint(cfg.checkpoint)
    settings = RunnerSettings(str(checkpoint), cfg.runner.device, inference_threads(cfg.runner.threads, 1),
                              rtc_schedule=cfg.rtc_schedule, rtc_max_guidance=cfg.rtc_max_guidance,
                              backend=cfg.backend)
    runner = settings.build()  # a bad checkpoint fails here, before the port is opened
    policy_cfg = runner.policy.config
    layout = ObservationLayout.for_policy(runner.policy, cfg.keys, cfg.key_map, cfg.rtc, cfg.max_prompt_chars)
    metadata = {
        "server": "roboscale", "policy": runner.policy.name, "checkpoint": str(checkpoint),
        # an export names the weights it was exported from: a client sees the same policy on either backend
        "checkpoint_sha256": runner.policy.weights_sha256 if onnx else sha256_file(checkpoint / "model.safetensors"),
        "policy_config": to_dict(policy_cfg),
        "n_action_steps": policy_cfg.n_action_steps, "rtc": cfg.rtc, "device": str(runner.device),
        "backend": cfg.backend,
    }
    return PolicyServer(runner, layout, metadata, options, on_ready=on_ready)


def serve_policy(cfg: ServeConfig) -> None:
    """`roboscale serve`: build the server (a bad checkpoint or option fails before the port opens) and run it."""
    def ready(host: str, port: int) -> None:
        print(f"serving on ws://{host}:{port} (health: http://{host}:{port}{HEALTH_PATH}); Ctrl-C stops",
              flush=True)

    server = build_server(cfg, on_ready=ready)
    try:
        server.run()
    finally:
        server.predictor.close()
