"""`roboscale serve`: the policy server's options."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from roboscale.configs.rollout import RunnerConfig
from roboscale.errors import ConfigError

KEY_PRESETS = ("checkpoint", "openpi_libero", "openpi_droid")


def serve_runner() -> RunnerConfig:
    """The server's runner defaults: batches of at most 16 robots' observations."""
    return RunnerConfig(max_batch_size=16)


BACKENDS = ("torch", "onnx")
"""What runs a policy (``rollout.inference.RunnerSettings.backend``)."""


@dataclass
class ServeConfig:
    """`roboscale serve`: a trained policy behind openpi's websocket policy protocol, for robot clients
    (``openpi_client.WebsocketClientPolicy``) and for `roboscale eval --rollout.server=ws://HOST:PORT`."""

    checkpoint: str = ""
    """A pretrained_model directory, a checkpoints/<step> directory, or a training output_dir (uses its last); with
    --backend=onnx, a directory `roboscale export --format=onnx` wrote."""
    backend: str = "torch"
    """What runs the policy: torch, or onnx (onnxruntime on an exported directory; --runner.device cpu, cuda or
    tensorrt picks its execution provider)."""
    host: str = "127.0.0.1"
    """The interface to listen on. Anything but a loopback address needs --api_key_file."""
    port: int = 8000
    """The TCP port (0: any free one, printed at start)."""
    api_key_file: str = ""
    """A file whose first line is the API key clients send (openpi's ``Authorization: Api-Key KEY`` header);
    empty: no key (loopback only)."""
    keys: str = "checkpoint"
    """The observation keys clients send: checkpoint (the checkpoint's own feature names:
    observation.images.<camera>, observation.state, prompt or task), openpi_libero (openpi's LIBERO example client:
    observation/image, observation/wrist_image, observation/state, prompt), openpi_droid (openpi's DROID example:
    observation/exterior_image_1_left, observation/wrist_image_left, observation/joint_position +
    observation/gripper_position, prompt)."""
    key_map: dict[str, str] = field(default_factory=dict)
    """Feature -> the client's key, over the preset: e.g. {observation.images.wrist: cam/wrist, observation.state:
    joints+gripper} (a state from several keys joins them, in order, with '+'; the instruction is ``prompt``)."""
    runner: RunnerConfig = field(default_factory=serve_runner)
    """Where the policy runs (--runner.device: auto is cuda if available; --runner.threads 0: every core) and how
    the observations of different connections are batched (a batch goes at once when every predicting connection
    has asked)."""
    max_message_mb: float = 4.0
    """The largest message a client may send (a larger one closes its connection with code 1009, before it is
    read). 4 MiB holds four 640x480 RGB frames (the server fits them to the policy's size). websockets reads and
    unmasks a frame whole on the loop every connection shares, so the larger the limit, the longer one client's
    message can hold the others (not measured per size): raise it only for clients that need it."""
    max_prompt_chars: int = 2000
    """The longest instruction a client may send (a longer one is refused in an error frame): its tokenizing runs
    with the model's batch."""
    rtc: bool = False
    """Real-time chunking: a request that carries ``committed`` (the previous chunk's actions not yet executed)
    and ``delay`` (of those, how many run before this chunk arrives) gets a chunk guided to agree with them."""
    rtc_schedule: str = "exp"
    """How the guidance weights of the committed actions after the delay decay: exp (the paper's), linear, ones,
    zeros (only the delay's actions)."""
    rtc_max_guidance: float = 5.0
    """The largest guidance weight (beta of the paper: 5)."""
    shutdown_grace_s: float = 10.0
    """On SIGINT/SIGTERM: how long requests in flight get to be answered before the connections close."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.keys not in KEY_PRESETS:
            raise ConfigError(f"--keys must be one of {list(KEY_PRESETS)}, got {self.keys!r}")
        from roboscale.models.rtc import SCHEDULES  # the policy's own list (serving loads torch anyway)

        if self.rtc_schedule not in SCHEDULES:
            raise ConfigError(f"--rtc_schedule must be one of {list(SCHEDULES)}, got {self.rtc_schedule!r}")
        if self.max_prompt_chars <= 0:
            raise ConfigError(f"--max_prompt_chars must be a positive integer, got {self.max_prompt_chars}")
        for name in ("max_message_mb", "rtc_max_guidance", "shutdown_grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name} must be a positive number, got {value}")
