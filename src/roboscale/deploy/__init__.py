"""A trained policy on the robot's own computer: ONNX export (``export``, needs torch) and the runtime that runs the
exported directory with onnxruntime and numpy alone (``runtime``, ``format``)."""
