"""The draft service: a small model proposing gamma tokens per step, each with its q."""
