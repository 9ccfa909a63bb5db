"""LeRobot v3.0 datasets: read (``LeRobotDataset``, ``LeRobotDatasetMetadata``), write (``DatasetWriter``) and
stream training batches (``build_loader``: raw datasets, lakes, mixtures; see ``roboscale.data.loader``)."""

from roboscale.data.lerobot_format import CODEBASE_VERSION
from roboscale.data.loader import build_loader
from roboscale.data.reader import LeRobotDataset, LeRobotDatasetMetadata
from roboscale.data.writer import DatasetWriter

__all__ = ["CODEBASE_VERSION", "DatasetWriter", "LeRobotDataset", "LeRobotDatasetMetadata", "build_loader"]
