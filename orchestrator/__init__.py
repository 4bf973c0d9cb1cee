"""The orchestrator: the public API. Drives draft and target, applies rejection sampling."""
