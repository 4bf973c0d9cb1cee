"""specdec: distributed speculative decoding (shared package).

Layout: ``sampling`` (the math), ``model`` (loading, KV sessions),
``sessions`` (the session store), ``model_service`` (what draft and target
services share), ``config``, ``metrics``, ``errors``, ``server`` (gRPC
plumbing), ``cli``; generated stubs in ``v1``.
"""

__version__ = "0.1.0"
