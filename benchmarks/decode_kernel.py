"""The draft's one-token passes in one compiled call (``decode_kernel``, the
default) against the runner's torch calls, side by side.

    python -m benchmarks.decode_kernel [--repeats 4] [--clients 8] [--passes 200]
        [--out results/decode-kernel-<time>]

Parts:
- pass times: the demo draft's passes through the ragged runtime on 1 thread, one
  runner switching between the kernel and its own torch calls pass by pass,
  packed as a service packs it (only a lone session's one-token pass, ``1x1``,
  takes the kernel: the other shapes show that nothing else changed);
- one client, two ways of serving, each with the setting on and off: the three
  services (one torch thread each) and one process (``orchestrator.local_models``,
  as ``benchmarks.head_to_head`` runs it); plain decoding, gamma 4 greedy and at
  T=1, adaptive at T=1; every arm's rounds interleaved (``benchmarks.run.measure``),
  each mode's time per step split into forwards and the rest (issue 15's
  orchestration overhead), and each arm's acceptance (the kernel's q round
  differently from the torch calls': alpha should not move);
- sustained rounds of ``--clients`` clients on the three services (none: skipped).
Paired ratios. Prints a table; writes results.json and results.md.
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.runtime import packed_linear
from specdec.runtime.loading import load_model
from specdec.runtime.ragged import RaggedRunner

from .common import torch_threads
from .fused_projections import side_by_side_both_ways
from .lean_forward import alternating_passes, side_by_side_args

MODES = {
    "plain@0": {"temperature": 0.0, "gamma": 0},
    "seq4@0": {"temperature": 0.0, "gamma": 4, "overlap": False},
    "seq4@1": {"temperature": 1.0, "gamma": 4, "overlap": False},
    "adaptive@1": {"temperature": 1.0, "gamma": None, "seed": None},
}
ARMS = ("torch", "kernel")


def pass_times(path: str, passes: int) -> dict[str, dict[str, float]]:
    """{shape: {torch, kernel, torch_best, kernel_best}} ms, one thread, one runner."""
    with torch_threads(1):
        model = load_model(path)
        runner = RaggedRunner(model)
        packed_linear.pack_model(model, runner, 64, 0)  # as a service packs
        if not runner.use_decode_kernel():
            raise SystemExit(f"{path}: its passes cannot run in the decode kernel")
        kernel = runner._decode

        def way(on: bool) -> Callable[[], None]:
            return lambda: setattr(runner, "_decode", kernel if on else None)

        return alternating_passes(runner, {arm: way(arm == "kernel") for arm in ARMS}, passes)


def _alpha(row: dict) -> str:
    return "-" if row.get("alpha") is None else f"{row['alpha']:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_args(__doc__, "decode-kernel", 4).parse_args(argv)
    alpha = ("alpha torch / kernel", lambda a, b: f"{_alpha(a)} / {_alpha(b)}")
    return side_by_side_both_ways(
        args,
        "The draft's one-token passes in one compiled call against its torch calls",
        "decode_kernel",
        ARMS,
        MODES,
        lambda: {"draft, 1 thread": pass_times(args.draft, args.passes)},
        alpha,
    )


if __name__ == "__main__":
    raise SystemExit(main())
