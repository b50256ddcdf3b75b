"""Importers: what frameworks already dump, converted into the run layout (FACTS §7).

Each importer module converts one framework's dump, streaming, into ``SampleRecord``s: its layer
axis, its dtype and its missing-row filler (zero rows, ``arange`` dummies, −1 sentinels,
``router_padding_mask``) become the layout's explicit ``engine_captured`` mask, never routes.
Pickles are untrusted input: read only through an allowlist (``safe_pickle``'s unpickler for
SkyRL's and verl's framework classes, torch's ``weights_only`` loader for slime's plain dicts).

A module ``harness.audit.importers.<name>`` provides:

- ``DESCRIPTION``: what it reads (framework, release, flag that writes the dump);
- ``NOTES``: what the dump cannot show (printed in the report, e.g. "hash-level checks only");
- ``detect(path) -> bool``: whether ``path`` (a file or directory) looks like this dump;
- ``records(path, **options) -> Iterator[SampleRecord]``: the dump's samples, one at a time;
  options a dump does not record (``num_experts``, ``moe_layers``) are keyword arguments. With
  ``errors=`` a list, a file that cannot be read (damaged, hostile, not a regular file, past its
  time budget) is one line in it and the other files are still read (``each_file``); without it,
  the first such file raises.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from harness.audit.inputs import time_budget
from harness.audit.layout import LayoutError, SampleRecord
from harness.audit.writer import RunWriter

T = TypeVar("T")

IMPORTERS = ("skyrl", "verl", "slime", "nemo_rl", "megatron_lm")
"""Every importer, by the name ``rrh audit --from`` takes."""


def importer(name: str) -> ModuleType:
    """The importer module called ``name`` (``LayoutError`` naming the known ones otherwise)."""
    if name not in IMPORTERS:
        raise LayoutError(f"--from {name!r}: expected one of {list(IMPORTERS)}")
    return importlib.import_module(f"harness.audit.importers.{name}")


def detect(path: str | os.PathLike[str]) -> str | None:
    """The name of the importer whose dump ``path`` is, or ``None`` (a run layout, or nothing known)."""
    for name in IMPORTERS:
        try:
            if importer(name).detect(Path(path)):
                return name
        except ModuleNotFoundError:
            continue
    return None


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


def import_dump(
    name: str,
    source: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    errors: list[str] | None = None,
    **options: Any,
) -> list[Path]:
    """Convert the dump at ``source`` with importer ``name`` into run-layout files in ``directory``.

    ``options`` (``None`` values dropped) go to the importer's ``records``; one it does not take is
    refused, naming the importer, rather than silently ignored. ``errors``: a list that collects one
    line per file that could not be imported while the others are (else the first one raises).
    """
    module = importer(name)
    given = {k: v for k, v in options.items() if v is not None}
    accepted = inspect.signature(module.records).parameters
    unknown = sorted(k for k in given if k not in accepted)
    if unknown:
        raise LayoutError(f"--{unknown[0].replace('_', '-')}: the {name} importer does not take it")
    if errors is not None and "errors" in accepted:
        given["errors"] = errors
    records: Iterator[SampleRecord] = module.records(Path(source), **given)
    with RunWriter(directory) as writer:
        for record in records:
            try:
                writer.write(record)
            except LayoutError as err:  # a value the layout cannot hold: that sample is not imported
                if errors is None:
                    raise
                errors.append(f"{source}: step {record.step} sample {str(record.sample_key)[:64]}: {err}")
    return writer.files
