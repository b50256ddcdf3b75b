"""Importing a framework without its import-time noise in ``rrh audit``'s output.

verl 0.9.1 and what it pulls in (torchtitan, veomni, Transformer Engine / Apex probes, absl) print
some twenty lines of warnings when first imported: Python warnings, logging records, and writes to
the process's stdout and stderr, some from C++ (absl's "All log messages before
absl::InitializeLog()"). None of them is about the run being audited; printed between the import
line and the result, they read as if they were. ``quiet_imports`` imports the modules with all of
that swallowed: warnings ignored, logging disabled, ``sys.stdout``/``sys.stderr`` and file
descriptors 1 and 2 pointed at ``/dev/null``. An exception is not noise: it propagates (the caller
turns it into its own one-line error).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def _descriptors_silenced() -> Iterator[None]:
    """File descriptors 1 and 2 on ``/dev/null`` while the block runs (what C extensions write)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: list[tuple[int, int]] = []
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # not open in this process: nothing to silence
                continue
            os.dup2(null, fd)
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def quiet_imports(modules: Iterable[str]) -> None:
    """Import ``modules`` (dotted names) with their warnings, logging and stdout/stderr output
    swallowed (module docstring); a module already imported costs nothing. Exceptions propagate."""
    pending = [name for name in modules if name not in sys.modules]
    if not pending:
        return
    disabled = logging.root.manager.disable
    with warnings.catch_warnings(), _descriptors_silenced():
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                for name in pending:
                    importlib.import_module(name)
        finally:
            logging.disable(disabled)
