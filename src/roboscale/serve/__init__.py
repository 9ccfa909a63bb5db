"""Deployment: `roboscale serve`, a trained policy behind openpi's websocket policy protocol (``serve.server``),
with the robot client's observation checked and mapped onto the policy's inputs (``serve.observation``)."""
