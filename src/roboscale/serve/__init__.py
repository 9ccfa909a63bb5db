"""Deployment: `roboscale serve`, a trained policy behind openpi's websocket policy protocol. ``serve.server``: the
websocket server, over any ``Predictor``, an observation layout and metadata; ``serve.command``: the command that
assembles them from a checkpoint; ``serve.observation``: the robot client's observation checked and mapped onto
the policy's inputs (openpi's example clients' keys, or the checkpoint's own)."""
