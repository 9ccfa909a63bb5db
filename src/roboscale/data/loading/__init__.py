"""The streaming loader: the ``FrameSource`` contract and its raw-dataset implementation (``source``,
``raw_source``, ``decode``), and ``build_loader`` (``loader``) with its sample ids (``index``), epoch plan
(``plan``), worker side (``worker``), shared-memory hand-over (``transport``) and dataset metadata (``meta``)."""
