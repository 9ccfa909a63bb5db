"""Data-parallel training over ranks: the process group (``env``), the device mesh a strategy needs (``mesh``),
and parallelism applied to a plain policy from outside (``parallelize``), as torchtitan does it."""
