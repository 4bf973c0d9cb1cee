"""specdec: distributed speculative decoding (shared package).

Layout: ``sampling`` (the math: p, q, the proposal on the wire, the
residual), ``rng`` (64-bit counter-based draws), ``wire`` (the one codec and
validator between domain values and protobuf), ``runtime`` (loading a model,
the ragged multi-session forward, the continuous-batching forward loop),
``model_service`` and ``sessions`` (what draft and target services share),
``transport`` (gRPC servers, channels, the status mapping, session streams),
``config``, ``metrics``, ``errors``, ``cli``; generated stubs in ``v1``.
"""

__version__ = "0.2.0"
