"""LeRobot v3.0 datasets: read (``LeRobotDataset``, ``LeRobotDatasetMetadata``) and write (``DatasetWriter``)."""

from roboscale.data.lerobot_format import CODEBASE_VERSION
from roboscale.data.reader import LeRobotDataset, LeRobotDatasetMetadata
from roboscale.data.writer import DatasetWriter

__all__ = ["CODEBASE_VERSION", "DatasetWriter", "LeRobotDataset", "LeRobotDatasetMetadata"]
