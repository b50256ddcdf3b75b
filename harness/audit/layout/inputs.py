"""Opening what a user brings: regular files only, texts and JSON read to one-line errors, a time
budget per file, and values described in bounded words.

An audit reads files it did not write (framework dumps, tap manifests, run-layout files). Each is
opened here, so that:

- only a **regular file** is read: a FIFO would block forever, ``/dev/zero`` (or a symlink to it)
  would never end, a directory or a dangling symlink is not a dump. A FIFO is opened without
  blocking and refused by what ``fstat`` says of the open descriptor, not of the name;
- a file that cannot be read (missing, unreadable, not UTF-8, JSON nested past the recursion limit,
  an integer of more digits than Python converts) is one ``LayoutError`` naming it;
- a file's work runs under ``time_budget``: past it, a ``LayoutError`` naming the file and the
  budget is raised in the main thread (``SIGALRM``; elsewhere the budget is not enforced);
- an error message never prints a value from a file at its full size (``brief``): a list that
  shares one large bytes object a million times would otherwise print gigabytes;
- the files opened while a block runs can be counted (``counting_opened``): ``rrh audit`` says how
  many files of a framework's dump it read, not how many of the run layout it wrote them into.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import math
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from harness.audit.layout.schema import LayoutError

T = TypeVar("T")

FILE_SECONDS_ENV = "RRH_FILE_SECONDS"
"""Environment variable: the base time budget of one input file, in seconds (default ``FILE_SECONDS``)."""
FILE_SECONDS = 30.0
FILE_BYTES_PER_SECOND = 20 << 20
"""The budget grows by one second per this many bytes of the file: a large dump takes longer to read."""


_OPENED: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("rrh_inputs_opened", default=None)
"""The paths ``open_regular`` opened inside ``counting_opened`` (``None``: nothing counts them)."""


@contextlib.contextmanager
def counting_opened() -> Iterator[set[str]]:
    """The set of input files (their resolved paths, each once) that ``open_regular`` opens while the
    block runs: what an import read of a dump, whatever the number of run-layout files it wrote."""
    opened: set[str] = set()
    token = _OPENED.set(opened)
    try:
        yield opened
    finally:
        _OPENED.reset(token)


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """``path`` opened for binary reading, when it is a regular file (symlinks to one followed).

    Anything else is a ``LayoutError`` naming it: a FIFO or socket (it would block), a device
    (``/dev/zero`` never ends), a directory, a missing file or a dangling symlink, an unreadable one.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise LayoutError(
            f"{path}: cannot be opened ({_reason(err)}); expected a readable regular file"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LayoutError(f"{path}: is {_kind(info.st_mode)}; expected a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        opened = _OPENED.get()
        if opened is not None:
            opened.add(os.path.realpath(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _reason(err: OSError) -> str:
    if err.errno == errno.ENOENT and os.path.islink(err.filename or ""):
        return "a dangling symlink"
    return err.strerror or type(err).__name__


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    ):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def file_size(handle: IO[bytes]) -> int:
    """The size of an open file: the bytes actually there."""
    return os.fstat(handle.fileno()).st_size


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the regular file ``path`` (``LayoutError`` naming it otherwise)."""
    with open_regular(path) as handle:
        try:
            return handle.read()
        except OSError as err:
            raise LayoutError(f"{path}: cannot be read ({_reason(err)})") from None


def read_text(path: str | os.PathLike[str]) -> str:
    """The UTF-8 text of the regular file ``path``."""
    return decode_utf8(read_bytes(path), str(path))


def decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LayoutError(
            f"{where}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8; expected UTF-8 text"
        ) from None


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads(text)``, every way it can fail (syntax, nesting, huge integers) one ``LayoutError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise LayoutError(
            f"{where}: not JSON ({err.msg} at column {err.colno}); expected a JSON document"
        ) from None
    except RecursionError:
        raise LayoutError(
            f"{where}: JSON nested past the recursion limit; expected a shallow JSON document"
        ) from None
    except ValueError as err:  # an integer of more digits than int() converts
        raise LayoutError(f"{where}: not JSON ({_first_line(err)}); expected a JSON document") from None


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON document in the regular file ``path``."""
    return parse_json(read_text(path), str(path))


def lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each line of a UTF-8 regular file, read one line at a time."""
    with open_regular(path) as handle:
        for line_no, raw in enumerate(handle, start=1):
            yield line_no, decode_utf8(raw, f"{path}:{line_no}")


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:200]


def entries(directory: str | os.PathLike[str]) -> list[Path]:
    """The entries of ``directory``, sorted; one that cannot be listed (removed while the audit
    reads, unreadable) is a ``LayoutError`` naming it."""
    try:
        return sorted(Path(directory).iterdir())
    except OSError as err:
        raise LayoutError(
            f"{directory}: cannot be listed ({_reason(err)}); expected a readable directory"
        ) from None


def glob(directory: str | os.PathLike[str], pattern: str) -> list[Path]:
    """``Path(directory).glob(pattern)``, sorted, a directory that vanishes or cannot be read one
    ``LayoutError`` naming it."""
    try:
        return sorted(Path(directory).glob(pattern))
    except OSError as err:
        raise LayoutError(
            f"{directory}: cannot be listed ({_reason(err)}); expected a readable directory"
        ) from None


# --- values a file holds ----------------------------------------------------------------------------


class BFloat16Array(np.ndarray):  # type: ignore[type-arg]
    """A bfloat16 tensor's values widened to float32 (numpy has no bfloat16), its type recording what
    the file held, so that a message refusing it names ``bfloat16`` (``dtype_name``), not ``float32``."""


def dtype_name(array: Any) -> str:
    """The dtype the file held ``array`` in: ``bfloat16`` for a widened bfloat16 tensor, else numpy's."""
    return "bfloat16" if isinstance(array, BFloat16Array) else str(array.dtype)


INT_BITS = {32: (-(2**31), 2**31 - 1), 64: (-(2**63), 2**63 - 1)}


def check_ints(array: Any, bits: int, source: str, field: str) -> None:
    """``array`` holds integers that fit ``bits`` signed bits (the layout's int32 token ids)."""
    if array.dtype.kind not in "biu":
        raise LayoutError(f"{source}: field {field!r} holds {dtype_name(array)} values; expected integers")
    low, high = INT_BITS[bits]
    if array.size and (int(array.min()) < low or int(array.max()) > high):
        bad = int(array.min()) if int(array.min()) < low else int(array.max())
        raise LayoutError(
            f"{source}: field {field!r} holds {brief(bad)}; expected integers that fit int{bits}"
        )


def check_mask(array: Any, source: str, field: str) -> None:
    """``array`` is a 0/1 mask (booleans, integers or floats)."""
    if array.dtype.kind not in "biuf":
        raise LayoutError(f"{source}: field {field!r} holds {array.dtype} values; expected a 0/1 mask")
    if array.size and not ((array == 0) | (array == 1)).all():
        raise LayoutError(f"{source}: field {field!r} holds values other than 0 and 1; expected a 0/1 mask")


def check_step(step: Any, source: str) -> int:
    """A step number the layout can hold (int64)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise LayoutError(f"{source}: step {brief(step)}; expected an integer in [0, 2**63)")
    return step


# --- describing values from a file ---------------------------------------------------------------


def brief(value: Any, limit: int = 60) -> str:
    """A short description of ``value``: never longer than about ``limit`` characters, never the
    cost of printing a large or deep value (no ``repr`` of a container or an array)."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 64:
            return f"an integer of {value.bit_length()} bits"
        return repr(value)
    if isinstance(value, (str, bytes, bytearray)):
        head = value[:limit]
        text = repr(bytes(head) if isinstance(head, bytearray) else head)
        return text if len(value) <= limit else f"{text}… ({len(value)} long)"
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"{type(value).__name__} {dtype} {list(shape)[:8]}"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"{type(value).__name__} of {len(value)}"
    return kind_name(value)


def kind_name(value: Any) -> str:
    """What ``value`` is, in a message: its type's name, or for a reader's own stand-in (a numpy
    array a pickle never gave its contents) its ``BRIEF``, in the user's terms."""
    described = getattr(type(value), "BRIEF", None)
    return described if isinstance(described, str) else type(value).__name__


# --- time budget ----------------------------------------------------------------------------------


class FileTimeout(LayoutError):
    """The work on one input file ran past its time budget."""


def budget_seconds(nbytes: int = 0) -> float:
    """The time budget of a file of ``nbytes``: ``$RRH_FILE_SECONDS`` (default 30 s) plus a second per
    20 MiB."""
    text = os.environ.get(FILE_SECONDS_ENV)
    try:
        base = FILE_SECONDS if text is None else float(text)
    except ValueError:
        raise LayoutError(f"{FILE_SECONDS_ENV}={text!r}: expected a number of seconds") from None
    if not (math.isfinite(base) and base > 0):
        raise LayoutError(f"{FILE_SECONDS_ENV}={text!r}: expected a positive number of seconds")
    return base + max(0, nbytes) / FILE_BYTES_PER_SECOND


_budgets: list[tuple[float, str, float]] = []
"""The budgets in force in the main thread: ``(deadline, source, seconds)``, innermost last."""


def _expired(_signum: int, _frame: Any) -> None:
    if not _budgets:  # the last budget ended as its alarm came
        return
    deadline, source, seconds = min(_budgets)
    if time.monotonic() < deadline:  # an outer budget's alarm came early: wait for this one
        signal.setitimer(signal.ITIMER_REAL, deadline - time.monotonic())
        return
    raise FileTimeout(
        f"{source}: still being read after {seconds:g} s, its time budget ({FILE_SECONDS_ENV} sets the "
        "base); expected a file that reads in time (damaged or hostile?)"
    )


@contextlib.contextmanager
def time_budget(source: str | os.PathLike[str], seconds: float | None = None) -> Iterator[None]:
    """Raise ``FileTimeout`` naming ``source`` when the block runs past ``seconds`` (default: the
    budget of ``source``'s size). Nested budgets: the earliest deadline fires. Enforced with
    ``SIGALRM`` in the main thread only (elsewhere the block just runs)."""
    if seconds is None:
        try:
            size = os.stat(source).st_size
        except (OSError, ValueError):
            size = 0
        seconds = budget_seconds(size)
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    entry = (time.monotonic() + seconds, str(source), seconds)
    previous = signal.signal(signal.SIGALRM, _expired) if not _budgets else None
    _budgets.append(entry)
    signal.setitimer(signal.ITIMER_REAL, max(min(_budgets)[0] - time.monotonic(), 1e-3))
    try:
        yield
    finally:
        _budgets.remove(entry)
        if _budgets:
            signal.setitimer(signal.ITIMER_REAL, max(min(_budgets)[0] - time.monotonic(), 1e-3))
        else:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def read_file(file: str | os.PathLike[str], errors: list[str] | None, read: Callable[[], T]) -> T | None:
    """``read()``, the work on one input ``file``, under the file's time budget.

    A ``LayoutError`` (the file damaged, hostile, not a regular file, or past its budget) is raised
    when ``errors`` is None, else appended to ``errors`` (one line naming the file) and ``None`` is
    returned: the importer goes on with its other files, as the audit does with the run layout's.
    """
    try:
        with time_budget(file):
            return read()
    except LayoutError as err:
        if errors is None:
            raise
        errors.append(str(err))
        return None
