"""What predicts action chunks, wherever its model is: the ``Predictor`` protocol.

A protocol that is only types (as ``rollout.messages``): whoever asks for chunks is written against it, not against
a class. What implements it:

- ``rollout.inference.PolicyRunner``: a checkpoint loaded in this process (an env worker with
  ``--rollout.inference=worker``, an inference server process, `roboscale serve`);
- ``rollout.remote.RemotePolicy``: a policy server elsewhere, over websockets (``--rollout.server``).

Who uses it: the env worker (``rollout.worker``: whichever of the two its settings build), the inference server
process (``rollout.server``) and `roboscale serve`'s websocket server (``serve.server``), which serves any
predictor through the rollout's dynamic batcher (tests serve a few-line fake). ``runtime_checkable`` so that a
test can check a class against it (``isinstance`` checks that the members exist, not their signatures).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from roboscale.rollout.inference import Prediction, PredictItem


@runtime_checkable
class Predictor(Protocol):
    version: int
    """The version of the weights predicting now (0: the checkpoint's; ``load_state`` sets others); each
    ``Prediction`` carries the version that made it."""

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        """One prediction per item, in order: its action chunk [T, A_data] in the dataset's units. The chunk's
        noise comes from the item's ``noise_seed`` and ``chunk_index`` alone (``rollout.noise``), so an item's
        chunk does not depend on the others of its call. A bad item raises ``ValueError``; an unreachable model
        raises ``WorkerError``. Called from one thread at a time (the model's)."""
        ...

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights and their version, checked before anything changes (a refused state leaves the weights and
        the version as they were); a predictor that cannot take weights (a remote one) raises ``WorkerError``."""
        ...

    def close(self) -> None:
        """Release what the predictor holds beyond memory (a remote one's connections); it is not used after."""
        ...
