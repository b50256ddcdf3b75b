"""``harness.audit.layout.inputs``: what a user brings is opened as a regular file, read to one-line
errors, worked on under a time budget, and described in bounded words.

A FIFO named like a dump would block an ``open`` forever and ``/dev/zero`` would never end: both
are refused by what the open descriptor is, before a byte is read. JSON nested past the
recursion limit or holding an integer of 5,000 digits is one ``LayoutError``. A file's work past
its budget is stopped with the file named; budgets nest. ``brief`` never prints a value whole.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.audit.layout import inputs
from harness.audit.layout.inputs import read_file
from harness.audit.layout.schema import LayoutError


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "dangling", "missing"])
def test_only_a_regular_file_is_opened(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "train_data_step1.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "dangling":
        path.symlink_to(tmp_path / "gone")
    expected = {"fifo": "is a FIFO", "dev-zero": "is a character device", "directory": "is a directory",
                "dangling": "a dangling symlink", "missing": "cannot be opened"}[kind]  # fmt: skip
    start = time.monotonic()
    with pytest.raises(LayoutError) as err:
        inputs.read_bytes(path)
    assert time.monotonic() - start < 5, "it blocked"
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value), str(err.value)
    target = tmp_path / "real"
    target.write_bytes(b"data")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert inputs.read_bytes(link) == b"data"  # a symlink to a regular file is read


@pytest.mark.parametrize(
    ("text", "expected"),
    [("[" * 100_000 + "]" * 100_000, "recursion limit"), ("9" * 5_000, "not JSON"), ('{"a": ', "not JSON")],
    ids=["deep", "huge-integer", "cut"],
)
def test_json_that_cannot_be_read_is_one_line(text: str, expected: str) -> None:
    with pytest.raises(LayoutError) as err:
        inputs.parse_json(text, "meta.json")
    assert str(err.value).startswith("meta.json: ") and expected in str(err.value)
    assert "\n" not in str(err.value)


def test_text_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(LayoutError, match=rf"^{path}:2: byte 7 \(0xff\) is not UTF-8"):
        list(inputs.lines(path))


def test_a_file_past_its_time_budget_is_named_and_the_next_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(inputs.FILE_SECONDS_ENV, "0.3")
    slow, fast = tmp_path / "slow.pkl", tmp_path / "fast.pkl"
    slow.write_bytes(b"x")
    fast.write_bytes(b"y")
    errors: list[str] = []
    start = time.monotonic()
    assert read_file(slow, errors, lambda: time.sleep(30)) is None
    assert time.monotonic() - start < 5
    assert read_file(fast, errors, lambda: "read") == "read"
    assert len(errors) == 1 and errors[0].startswith(f"{slow}: still being read after 0.3 s")
    with pytest.raises(inputs.FileTimeout):  # without an error list the first such file raises
        read_file(slow, None, lambda: time.sleep(30))


def test_nested_budgets_keep_the_earliest_deadline_and_clean_up() -> None:
    import signal

    before = signal.getsignal(signal.SIGALRM)
    with pytest.raises(inputs.FileTimeout, match="inner"), inputs.time_budget("outer", 30):
        with inputs.time_budget("inner", 0.2):
            time.sleep(10)
    with pytest.raises(inputs.FileTimeout, match="outer"), inputs.time_budget("outer", 0.3):
        with inputs.time_budget("inner", 30):
            time.sleep(10)
    with inputs.time_budget("done", 0.2):
        pass
    time.sleep(0.4)  # the alarm of a finished budget never fires
    assert signal.getsignal(signal.SIGALRM) == before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_brief_never_prints_a_value_whole() -> None:
    shared = b"x" * (1 << 20)
    assert len(inputs.brief([shared] * 100_000)) < 80
    assert len(inputs.brief("y" * 10**6)) < 120
    assert inputs.brief(10**5000) == f"an integer of {(10**5000).bit_length()} bits"
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert inputs.brief(deep) == "list of 1"
