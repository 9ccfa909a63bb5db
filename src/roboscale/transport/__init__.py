"""The transport: how observations and action chunks travel between processes that do not share memory, with no
knowledge of policies or of the rollout (so a client in a simulator's own venv needs msgpack, numpy and websockets,
not torch). ``transport.wire``: openpi's msgpack-numpy codec, decoded strictly (what both ends of any transport
send); ``transport.websocket``: openpi's websocket protocol, what both of its ends share (the API key file, the
optional dependency, the loopback rule) and the client's connection.

What sits above it: the rollout's ``RemotePolicy`` (``rollout.remote``), a ``Predictor`` over a connection, and
`roboscale serve`'s websocket server (``serve.server``), which serves a ``Predictor`` through the rollout's dynamic
batcher; both know the rollout's types, which is why neither is here. A second transport (gRPC, shared memory) is
a codec or a connection here, and one server module over the batcher and a ``Predictor``.
"""
