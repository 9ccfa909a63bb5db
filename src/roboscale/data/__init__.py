"""LeRobot v3.0 datasets: read (``LeRobotDataset``, ``LeRobotDatasetMetadata``), write (``DatasetWriter``) and
stream training batches (``build_loader``: raw datasets, lakes, mixtures; see ``roboscale.data.loading.loader``).

Three concerns, one subpackage each: ``lerobot`` (the LeRobot v3.0 format: reader, writer, converter, validation,
stats, video), ``loading`` (the streaming loader and the ``FrameSource`` contract it reads) and ``lake`` (datasets
compiled into memory-mappable shards with Ray Data).
"""

from roboscale.data.lerobot.format import CODEBASE_VERSION
from roboscale.data.lerobot.reader import LeRobotDataset, LeRobotDatasetMetadata
from roboscale.data.lerobot.writer import DatasetWriter
from roboscale.data.loading.loader import build_loader

__all__ = ["CODEBASE_VERSION", "DatasetWriter", "LeRobotDataset", "LeRobotDatasetMetadata", "build_loader"]
