"""The draft service: a small model that proposes gamma tokens per step, streaming each with its q."""
