"""``rrh audit --follow``: the follow loop (``harness.audit.follow``) wired to the terminal, the alerts and
the files a user watches: a line per step as it lands, a line per strict violation (``--fail-fast``
stops there, ``--on-violation CMD`` gets it as JSON on stdin), the series appended to ``--summary``
and ``--tensorboard``, and the ``--html`` page rewritten after each step."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.atomic import atomic_write
from harness.audit import AuditOptions
from harness.audit.checks.state import AuditState
from harness.audit.follow.series import SeriesWriter
from harness.audit.follow.sources import DumpSource, DumpStep, LayoutSource
from harness.audit.follow.trace_tail import TracedImport
from harness.audit.follow.watch import Follow, Followed, FollowOptions
from harness.audit.layout.schema import LayoutError, shown
from harness.audit.result.audit_result import AuditResult

ON_VIOLATION_SECONDS = 60.0
"""How long an ``--on-violation`` command may run before the follow goes on without it."""

FOLLOW_ONLY = ("until_step", "idle", "fail_fast", "on_violation", "tensorboard")


def check_follow_args(args: argparse.Namespace) -> None:
    """Refuse the follow-only options without ``--follow``, and what a follow cannot do."""
    if not args.follow:
        given = [n for n in FOLLOW_ONLY if getattr(args, n) not in (None, False)]
        if given:
            flag = given[0].replace("_", "-")
            raise LayoutError(f"--{flag}: only with --follow (a run audited as it trains)")
        return
    for name in ("idle", "poll", "settle"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise LayoutError(f"--{name}: {value}; expected a number of seconds above 0")


def _step_line(row: dict[str, Any], step_name: str) -> str:
    """``step 3: 16 samples, route agreement 0.9493, flipped tokens 0.0240, mean |Δ| …, 0 violating``."""
    parts = [f"{step_name} {row['step']}: {row['samples']} samples"]
    if row.get("disagreement") is not None:
        parts.append(f"route agreement {1 - row['disagreement']:.4f}")
        parts.append(f"flipped tokens {row['token_disagreement']:.4f}")
    if row.get("mean_abs_diff") is not None:
        gap = f"mean |Δ| {row['mean_abs_diff']:.3e}"
        if row.get("tokens_agreed") or row.get("tokens_flipped"):
            agreed, flipped = row.get("mean_abs_diff_agreed"), row.get("mean_abs_diff_flipped")
            gap += " (agreed " + ("-" if agreed is None else f"{agreed:.3e}")
            gap += ", flipped " + ("-" if flipped is None else f"{flipped:.3e}") + ")"
        parts.append(gap + f", k3 {row['k3']:.3e}")
    parts.append(f"{row['violations']} violating sample{'s' * (row['violations'] != 1)}")
    return ", ".join(parts)


def _finding_line(found: dict[str, Any], step_name: str) -> str:
    at = f"{step_name} {found['step']} sample {found['sample_key']}"
    at += f" row {found['row']}" if found.get("row") is not None else ""
    at += f" layer {found['layer']}" if found.get("layer") is not None else ""
    return (
        f"VIOLATED {found['invariant']} at {at}: expected {found['expected']}, got {found['actual']} "
        f"({found['where']})"
    )


def _run_command(command: str, found: dict[str, Any]) -> None:
    """Run ``--on-violation`` with the finding as JSON on stdin; a failure is said, the follow goes on."""
    try:
        done = subprocess.run(command, shell=True, input=json.dumps(found).encode(),
                              timeout=ON_VIOLATION_SECONDS, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"rrh audit: --on-violation ran past {ON_VIOLATION_SECONDS:.0f} s; stopped", file=sys.stderr)
        return
    if done.returncode:
        print(f"rrh audit: --on-violation exited {done.returncode}", file=sys.stderr)


def _source(args: argparse.Namespace, keep: list[Any], facts: dict[str, list[str]]) -> tuple[Any, str | None]:
    """The source to follow and the dump's importer (``None``: the run layout). A run not written yet
    is the run layout unless ``--from`` names its framework."""
    from harness.audit import importers

    root = Path(args.run)
    if args.source is None and (not root.exists() or (root.is_dir() and not any(root.iterdir()))):
        return LayoutSource(root), None
    name, dump = importers.locate(args.run, args.source) if root.exists() or args.source is None else (
        args.source, root)  # fmt: skip
    if name is None:
        return LayoutSource(dump), None
    if args.import_to:
        target = Path(args.import_to)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rrh-follow-")
        keep.append(tmp)
        target = Path(tmp.name)

    settle = 30.0 if args.settle is None else args.settle
    if args.trainer_trace:
        if name != "verl":
            raise LayoutError(
                f"--trainer-trace: {args.run} is a {name} dump; expected a verl RolloutSkip dump (the one "
                "framework whose packing the join computes)"
            )
        joined = TracedImport(args, settle)
        print(f"joining each step with megatron-core's router trace {shown(args.trainer_trace)} as it is "
              f"written (tp={joined.layout.tp}, cp={joined.layout.cp}, pp={joined.layout.pp}, "
              f"dp={joined.layout.dp}, replay {joined.layout.replay})", file=sys.stderr)  # fmt: skip
        return DumpSource(name, Path(dump), target, joined, settle, ready=joined.ready), name

    layers: list[Any] = [args.moe_layers]  # given, or inferred from the first step imported

    def import_step(step: DumpStep, into: Path, errors: list[str]) -> Any:
        inferred: list[str] = []
        files = importers.import_dump(
            name, step.entry, into, errors=None if args.strict else errors, inferred=inferred,
            notes=facts["notes"], num_experts=args.num_experts, moe_layers=layers[0], **dict(step.options),
        )  # fmt: skip
        if layers[0] is None and files:
            from harness.audit.layout.reader import first_model

            model = first_model(files[0])
            if model is not None:  # the later steps are read with the MoE layers the first one showed
                layers[0] = list(model[4])
                facts["inferred"] += [f"{line}; used for every later {step_name} (the run is followed)"
                                      for line in inferred]  # fmt: skip
        return files

    step_name = "rollout id" if name == "slime" else "step"
    return DumpSource(name, Path(dump), target, import_step, settle), name


def follow_run(args: argparse.Namespace, keep: list[Any]) -> tuple[AuditResult, str | None, int | None, str]:
    """Follow ``args.run``; the result, the dump's importer, the dump files read and why it ended."""
    check_follow_args(args)
    facts: dict[str, list[str]] = {"inferred": [], "notes": []}
    source, name = _source(args, keep, facts)
    step_name = "rollout id" if name == "slime" else "step"
    series = SeriesWriter(args.summary, args.tensorboard)
    command = shlex.join(["rrh", *args.argv])
    start = time.perf_counter()

    def on_step(row: dict[str, Any], layers: list[dict[str, Any]]) -> None:
        print(shown(_step_line(row, step_name)), flush=True)
        series.add(row, layers)

    def on_finding(found: dict[str, Any]) -> None:
        print(shown(_finding_line(found, step_name)), flush=True)
        if args.on_violation:
            _run_command(args.on_violation, found)

    def on_poll(state: AuditState, at: int | None) -> None:
        if not args.html:
            return
        from harness.report.audit_page import audit_html

        result = AuditResult.of(state)
        now = time.strftime("%H:%M:%S", time.localtime())
        where = f"at {step_name} {at} (page written {now})" if at is not None else f"no step complete ({now})"
        page = audit_html(result, title=str(args.run), command=command, seconds=time.perf_counter() - start,
                          following=where, live=True)  # fmt: skip
        atomic_write(args.html, lambda h: h.write(page.encode()))

    options = AuditOptions(steps=args.steps, every=max(1, args.every), samples=args.samples)
    follow = FollowOptions(
        poll=args.poll or 1.0, until_step=args.until_step, idle=args.idle, fail_fast=args.fail_fast
    )
    print(f"rrh audit --follow {shown(args.run)}: " + (f"a {name} dump" if name else "the run layout")
          + " (Ctrl-C ends it)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        done: Followed = Follow(
            source, on_step=on_step, on_finding=on_finding, on_poll=on_poll, options=options, follow=follow,
            executor=args.executor or "serial", workers=args.workers, ray_address=args.ray_address,
        ).run()  # fmt: skip
    finally:
        series.close()
    if not done.state.files and not done.state.input_errors:
        raise LayoutError(
            f"{args.run}: nothing was written while it was followed ({done.ended}); expected a run directory "
            "or a framework's dump folder being written"
        )
    result = AuditResult.of(done.state)
    result.inferred = list(dict.fromkeys(facts["inferred"]))
    if name is not None:
        from harness.audit import importers

        joined = getattr(source, "import_step", None)
        if isinstance(joined, TracedImport):  # as the one-shot join says it
            result.inferred = joined.inferred()
            result.notes = joined.notes()
            result.input_errors = sorted({*result.input_errors, *joined.tail.leftover(Path(source.dump))})
        else:
            facts_notes = importers.notes(name, num_experts=args.num_experts, moe_layers=args.moe_layers)
            said_notes = (*facts["notes"], *facts_notes)
            result.notes = list(dict.fromkeys(f"{name}: {note}" for note in said_notes))
    else:
        from harness.audit.tap.manifest import check_manifests

        manifests = check_manifests(source.run)
        result.notes = manifests.notes + result.notes
        result.input_errors = sorted({*result.input_errors, *manifests.errors})
    files = source.files_read if isinstance(source, DumpSource) else None
    said = {
        "idle": f"no new file for {args.idle or 0:g} s",
        "until-step": f"{step_name} {args.until_step} complete",
        "fail-fast": "--fail-fast at the first violation", "interrupted": "interrupted",
    }  # fmt: skip
    return result, name, files, f"followed {len(done.reported)} {step_name}s; ended: {said[done.ended]}"
