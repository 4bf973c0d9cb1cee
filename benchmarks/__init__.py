"""Benchmarks for specdec: pair analysis (alpha, c, predicted speedup) and the
side-by-side measurement of plain decoding, speculative decoding through the
services, and Hugging Face assisted generation (``python -m benchmarks.run``).
See docs/benchmarks.md.
"""
