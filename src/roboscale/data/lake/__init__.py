"""The data lake: LeRobot v3.0 datasets compiled by Ray Data into memory-mappable shards (``build`` and the modules
it runs: ``staging``, ``planning``, ``shards``, ``stats``, ``ray``, ``manifest``), on-disk names (``format``), and
``LakeSource`` (``source``), which reads a lake without Ray."""
