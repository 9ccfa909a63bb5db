"""`roboscale plan`: an analytical scaling model of data-parallel training (compute, FSDP/HSDP communication,
data rate) for a policy preset at several GPU counts.

- ``model``: the pure model (``predict_step_time``, ``plan_rows``; Workload, Network, Cluster, Row);
- ``workload``: what a policy config implies (FLOPs, weights moved, loader cost per sample);
- ``paper``: the seed paper's GR00T round through the model;
- ``run`` / ``report``: from the command's config to results, and their text.
"""

from roboscale.plan.model import (
    Cluster,
    Network,
    Row,
    StepTime,
    Workload,
    bytes_across_nodes,
    comm_seconds,
    plan_rows,
    predict_step_time,
)
from roboscale.plan.workload import DataCost, workload_of

__all__ = ["Cluster", "DataCost", "Network", "Row", "StepTime", "Workload", "bytes_across_nodes", "comm_seconds",
           "plan_rows", "predict_step_time", "workload_of"]
