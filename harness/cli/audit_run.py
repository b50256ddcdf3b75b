"""``rrh audit``: import a framework's dump if asked, audit the run, print and write the report.

The terminal shows a progress bar over the bytes of the run (tqdm: bytes, rate, ETA) and one
line per invariant; ``--html``, ``--json`` and ``--summary`` write the same result for a reader,
a program and a query engine. Exit 0 clean, 1 a strict violation (or a figure over
``--fail-on``), 2 a usage or input error; a detector's suspicion (``SUSPECT``) leaves it 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from harness.atomic import atomic_write
from harness.audit import AuditOptions, audit_run
from harness.audit.layout.schema import LayoutError, shown
from harness.audit.result.audit_result import AuditResult, human_size

REPORT_FORMAT = "rrh-audit-report/1"


def _progress(enabled: bool) -> Any:
    """A wrapper of the stream of finished units that drives a tqdm bar over their bytes."""

    def wrap(stream: Iterable[Any], total: int) -> Iterator[Any]:
        from tqdm import tqdm

        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="audit", file=sys.stderr,
                  disable=not enabled, dynamic_ncols=True) as bar:  # fmt: skip
            for unit, state in stream:
                bar.update(unit.nbytes)
                yield unit, state

    return wrap


def report_document(result: AuditResult, *, run: str, command: str, seconds: float) -> dict[str, Any]:
    """The JSON report (schema ``harness/schemas/audit_report.schema.json``)."""
    return {"format": REPORT_FORMAT, "run": run, "command": command, "seconds": seconds, **result.as_dict()}


def _import(
    args: argparse.Namespace, keep: list[Any], errors: list[str]
) -> tuple[str, str | None, list[str], list[str], int | None]:
    """The run-layout directory to audit (``args.run`` itself, or the dump found there imported into
    one), the importer (``None``: the run layout), what it inferred, its notes and how many files of
    the dump it read (``None``: the run layout).

    A dump file that cannot be imported is a line in ``errors`` (an input error of the audit), and
    the other files are imported; with none imported, the first errors are raised."""
    from harness.audit import importers

    name, dump = importers.locate(args.run, args.source)
    if args.trainer_trace and name != "verl":
        raise LayoutError(
            f"--trainer-trace: {args.run} is {'the run layout' if name is None else f'a {name} dump'}; "
            "expected a verl RolloutSkip dump (the one framework whose packing the join computes)"
        )
    if name is None:
        return str(dump), None, [], [], None
    if args.import_to:
        target = args.import_to
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rrh-audit-")
        keep.append(tmp)
        target = tmp.name
    from harness.audit.layout.inputs import counting_opened

    if args.trainer_trace:
        from harness.audit.trace import join as trace_join

        with counting_opened() as opened:
            joined, notes = trace_join.import_for_cli(args, dump, target)
        return target, name, joined, notes, len(opened)
    module = importers.importer(name)
    found = "" if Path(dump) == Path(args.run) else f" (found below {shown(args.run)})"
    print(f"importing {shown(dump)}{found} as a {module.DESCRIPTION}", file=sys.stderr)
    inferred: list[str] = []
    said: list[str] = []  # what the importer said of this dump as it read it
    with counting_opened() as opened:
        files = importers.import_dump(
            name, dump, target, errors=None if args.strict else errors, inferred=inferred, notes=said,
            num_experts=args.num_experts, moe_layers=args.moe_layers,
        )  # fmt: skip
    if not files and errors:  # nothing imported: no run to audit, only the files that failed
        raise LayoutError(
            "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")
        )
    facts = importers.notes(name, num_experts=args.num_experts, moe_layers=args.moe_layers)
    return target, name, inferred, [f"{name}: {note}" for note in (*said, *facts)], len(opened)


def _trace_alone(args: argparse.Namespace) -> int | None:
    """A megatron-core router trace given alone: its own rules checked and printed, the exit status
    (``None``: not a trace alone)."""
    from harness.audit import importers

    name, dump = importers.locate(args.run, args.source)
    if name != "megatron_lm" or args.trainer_trace:
        return None
    lines, violated = importers.importer(name).trace_report(Path(dump), num_experts=args.num_experts)
    print(f"rrh audit {shown(args.run)}: megatron-core's router trace {shown(dump)}")
    for line in lines:
        print(shown(line))
    return 1 if violated else 0


def _path_problem(err: BaseException, run: str) -> str:
    """An ``OSError``, ``RecursionError`` or ``UnicodeError`` met while finding or reading ``run`` as
    one line: the file it names (else the run) and the problem, never a traceback."""
    if isinstance(err, RecursionError):
        return f"{shown(run)}: folders nested deeper than the recursion limit; expected a run directory"
    if isinstance(err, UnicodeError):
        return f"{shown(run)}: a file name that is not UTF-8 below it ({type(err).__name__}); rename it"
    name = err.filename if isinstance(err, OSError) and err.filename else run
    text = shown(os.fspath(name))
    if len(text) > 300:
        text = f"{text[:120]}…{text[-120:]} ({len(text)} characters)"
    why = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
    return f"{text}: {why}; expected a readable run directory or file"


def _audit_once(
    args: argparse.Namespace, keep: list[Any], import_errors: list[str]
) -> tuple[AuditResult, str | None, int | None]:
    """The one-shot audit: the dump imported if it is one, the run audited; the result, the dump's
    importer (``None``: the run layout) and the dump files read."""
    run, name, inferred, notes, dump_files = _import(args, keep, import_errors)
    options = AuditOptions(steps=args.steps, every=max(1, args.every), samples=args.samples)
    result = audit_run(
        run,
        options=options,
        executor=args.executor or "processes",
        workers=args.workers,
        ray_address=args.ray_address,
        strict=args.strict,
        progress=_progress(args.progress and sys.stderr.isatty()),
        input_errors=import_errors,
    )
    result.inferred = inferred + result.inferred
    result.notes = result.notes + notes
    return result, name, dump_files


def run_audit(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    keep: list[Any] = []
    import_errors: list[str] = []
    try:
        alone = None if args.follow else _trace_alone(args)
        if alone is not None:
            return alone
        ended = ""
        if args.follow:
            from harness.cli.audit_follow import follow_run

            result, name, dump_files, ended = follow_run(args, keep)
        else:
            from harness.cli.audit_follow import check_follow_args

            check_follow_args(args)
            result, name, dump_files = _audit_once(args, keep, import_errors)
    except LayoutError as err:
        print(f"rrh audit: {err}", file=sys.stderr)
        return 2
    except (OSError, RecursionError, UnicodeError) as err:
        # What the file system says of the path itself (a name too long, folders nested past the
        # recursion limit, a name that is not UTF-8), wherever it is found: one line naming it.
        print(f"rrh audit: {_path_problem(err, args.run)}", file=sys.stderr)
        return 2
    finally:
        for tmp in keep:
            tmp.cleanup()
    result.dump_files = dump_files
    seconds = time.perf_counter() - start
    # An input error comes first, on stderr, one line each; with nothing audited it is all there is.
    for error in result.input_errors:
        print(f"rrh audit: input error: {shown(error)}", file=sys.stderr)
    if result.input_errors and not result.rows:
        return 2
    if ended:
        print(f"rrh audit {shown(args.run)}: {ended}")
    if name is None:
        print(f"rrh audit {shown(args.run)}: {result.files_read()}, {result.counted()}, "
              f"{human_size(result.bytes_read)} in {seconds:.1f}s")  # fmt: skip
    else:
        layout = human_size(result.bytes_read)
        print(f"rrh audit {shown(args.run)}: {result.counted()} of a {name} dump ({result.files_read()} "
              f"read; imported: {layout} of run layout) in {seconds:.1f}s")  # fmt: skip
    for line in result.lines():  # offenders' places name files: printed safe, like every path
        print(shown(line))
    if result.input_errors:
        print(f"incomplete: {len(result.input_errors)} input error(s), printed first on stderr; everything "
              "else was audited")  # fmt: skip
    over = result.over(args.fail_on)
    for line in over:
        print(f"over threshold: {shown(line)}")
    command = shlex.join(["rrh", *args.argv])
    if args.json:
        doc = report_document(result, run=str(args.run), command=command, seconds=seconds)
        text = json.dumps(doc, indent=2, allow_nan=False)
        atomic_write(args.json, lambda h: h.write(text.encode()))
        print(f"JSON report: {shown(args.json)}")
    if args.html:
        from harness.report.audit_page import audit_html

        page = audit_html(result, title=str(args.run), command=command, seconds=seconds, following=ended)
        atomic_write(args.html, lambda h: h.write(page.encode()))
        print(f"HTML report: {shown(args.html)}")
    if args.summary:
        from harness.audit.result.summary import write_summary

        paths = write_summary(result, args.summary)
        print(f"summary tables: {', '.join(shown(Path(p)) for p in paths)}")
    if result.input_errors:
        return 2
    return 1 if result.violated or over or ended.endswith("--fail-fast at the first violation") else 0
