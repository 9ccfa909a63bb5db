"""The configs of the jobs a user runs (data, lake, train, eval, demo, model info), side by side.

Each is a typed dataclass whose field docstrings are its ``--help``. They import nothing heavy (no torch models,
no Ray): the command line parses them before deciding what to load.
"""
