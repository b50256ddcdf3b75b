"""``rrh audit``: its arguments; the audit itself (import, audit, print, write) is
``harness.cli.audit_run``, imported when the command runs."""

from __future__ import annotations

import argparse
from typing import Any

from harness.cli.args import parse_fraction, parse_steps, parse_threshold


def _cmd_audit(args: argparse.Namespace) -> int:
    """``rrh audit``: 0 clean, 1 a strict violation or a figure over ``--fail-on``, 2 an input error (a
    detector's suspicion, ``SUSPECT``, leaves it 0)."""
    from harness.cli.audit_run import run_audit

    return run_audit(args)


def add_parser(commands: Any) -> None:
    """Register ``rrh audit`` on the ``rrh`` parser's sub-commands."""
    audit = commands.add_parser(
        "audit",
        help="check a real run's dumps: every sample, row and layer",
        description="Check what a run wrote to disk (the run layout, or a framework's own dump with --from) "
        "against the strict invariants and metrics of DESIGN §7. Exit 0 clean, 1 a strict violation or a "
        "figure over --fail-on, 2 a usage or input error (a detector's suspicion, SUSPECT, is not a "
        "violation).",
    )
    audit.add_argument(
        "run", metavar="RUN", help="a run directory (or file) of the run layout, or a framework dump"
    )
    audit.add_argument(
        "--from",
        dest="source",
        metavar="NAME",
        help="the dump's framework (skyrl, verl, slime, nemo_rl, megatron_lm); default: detected",
    )
    audit.add_argument(
        "--num-experts",
        type=int,
        default=None,
        metavar="E",
        help="experts per MoE layer, for dumps that do not record it (SkyRL, verl, slime)",
    )
    audit.add_argument(
        "--moe-layers",
        type=lambda t: sorted(parse_steps(t)),
        default=None,
        metavar="SPEC",
        help="decoder indices of the MoE layers (e.g. 1-47), for dumps that do not record them",
    )
    audit.add_argument(
        "--trainer-trace",
        metavar="DIR",
        help="megatron-core's router trace of the same run (router_trace_rank{r}.jsonl): joined with a verl "
        "dump through verl 0.9.1's own packing, it gives replay_fidelity per step, sample, row and layer "
        "(with --follow, each step once every rank's trace has moved past it)",
    )
    audit.add_argument(
        "--trainer-layout",
        metavar="SPEC",
        default="",
        help="how the traced run was laid out: tp=2,cp=2,pp=2,dp=1 and max_token_len=N (use_dynamic_bsz) or "
        "micro_batch=N, balance_batch=0 if turned off; replay=R2 (default R3) with the update's "
        "ppo_mini_batch=N, ppo_epochs=N, shuffle=1, seed=N and ppo_max_token_len=N or ppo_micro_batch=N "
        "(with --trainer-trace)",
    )
    audit.add_argument(
        "--import-to",
        metavar="DIR",
        help="keep the imported run layout here (default: a temporary directory)",
    )
    audit.add_argument(
        "--executor",
        choices=("serial", "processes", "ray"),
        default=None,
        help="where the audit's units run: serial (this process), processes (a pool of --workers), "
        "ray (a Ray cluster, --ray-address; extra 'ray'); default processes, with --follow serial",
    )
    audit.add_argument(
        "--workers", type=int, default=None, help="processes (default: the CPUs this process may use)"
    )
    audit.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="a Ray cluster (default: a local one)"
    )
    audit.add_argument(
        "--steps", type=parse_steps, default=None, metavar="SPEC", help="only these steps: 3, 0-9, 1,4,7-8"
    )
    audit.add_argument("--every", type=int, default=1, metavar="N", help="only steps divisible by N")
    audit.add_argument(
        "--samples",
        type=parse_fraction,
        default=1.0,
        metavar="FRACTION",
        help="a hash-selected fraction of samples (the same samples in every audit of the run)",
    )
    audit.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report with plots")
    audit.add_argument("--json", metavar="PATH", help="also write the result as JSON (schema: audit_report)")
    audit.add_argument(
        "--summary", metavar="DIR", help="also write per-step, per-layer and per-sample Parquet tables"
    )
    audit.add_argument(
        "--fail-on",
        type=parse_threshold,
        action="append",
        default=[],
        metavar="FIGURE=VALUE",
        help="exit 1 when a step's figure exceeds VALUE (e.g. mean_abs_diff=0.01, disagreement=0.05)",
    )
    audit.add_argument("--strict", action="store_true", help="stop at the first violation or input error")
    _add_follow(audit)
    audit.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    audit.set_defaults(func=_cmd_audit)


def _add_follow(audit: Any) -> None:
    """``--follow`` and the options of a followed run."""
    follow = audit.add_argument_group("following a run as it trains")
    follow.add_argument(
        "--follow",
        action="store_true",
        help="audit each step as soon as its files are complete, while the run writes them (the run layout, "
        "or a skyrl, verl, slime or nemo_rl dump folder: give --from for one not written yet)",
    )
    follow.add_argument(
        "--until-step", type=int, default=None, metavar="N", help="end once step N is complete"
    )
    follow.add_argument(
        "--idle", type=float, default=None, metavar="SECONDS", help="end after SECONDS without a new file"
    )
    follow.add_argument(
        "--poll", type=float, default=None, metavar="SECONDS", help="look for new files every SECONDS (1)"
    )
    follow.add_argument(
        "--settle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a dump's last step is complete once its files are unchanged for SECONDS (30); an earlier step "
        "is complete when the next one appears (a --trainer-trace step: once every rank traced a later "
        "one, or traced it and then nothing for SECONDS)",
    )
    follow.add_argument(
        "--fail-fast", action="store_true", help="exit 1 at the first strict violation, naming its place"
    )
    follow.add_argument(
        "--on-violation",
        metavar="CMD",
        default=None,
        help="run CMD (a shell command) for each strict violation, the finding as JSON on its stdin",
    )
    follow.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="write each step's figures as TensorBoard scalars into DIR (extra 'tensorboard')",
    )
