"""Importers: what frameworks already dump, converted into the run layout (FACTS §7).

Each importer module converts one framework's dump, streaming, into ``SampleRecord``s: its layer
axis, its dtype and its missing-row filler (zero rows, ``arange`` dummies, −1 sentinels,
``router_padding_mask``) become the layout's explicit ``engine_captured`` mask, never routes.
Pickles are untrusted input: read only through ``safe_pickle``'s allowlist unpickler (SkyRL's and
verl's framework classes as stand-ins; slime's ``torch.save`` archives too: torch never unpickles
anything). Files are opened only when regular (``harness.audit.layout.inputs``), and each is read under a
time budget.

A module ``harness.audit.importers.<name>`` provides:

- ``DESCRIPTION``: what it reads (framework, release, flag that writes the dump);
- ``NOTES``: a tuple of sentences, what the dump cannot show (printed in the report, e.g.
  "hash-level checks only"); ``FACT_NOTES``: for each model fact it does not record (``num_experts``,
  ``moe_layers``), a sentence printed only when the caller did not give it;
- ``HINTS``: for each column an invariant may miss (``audit_result.HINTS``' keys), what in
  *this* framework writes it, or that nothing in it does; ``SOURCE_PREFIXES``: how the ``source``
  of its records starts (a re-audit of an imported run finds its hints by it);
- ``STEP_NAME`` (optional): what the dump's step is, where it is not a training step (slime's
  ``rollout id``): the report prints it where it prints a step;
- ``detect(path) -> bool``: whether ``path`` (a file or directory) looks like this dump;
- ``records(path, **options) -> Iterator[SampleRecord]``: the dump's samples, one at a time;
  options a dump does not record (``num_experts``, ``moe_layers``) are keyword arguments; an
  importer that infers them takes ``inferred: list[str]`` and appends what it inferred, in a line.
  With ``errors=`` a list, a file that cannot be read (damaged, hostile, not a regular file, past
  its time budget) is one line in it and the other files are still read (``read_file``); without
  it, the first such file raises.

What importers share is in ``base`` (the routing shape, a padded route tensor's samples, the file
loop) and ``model_shape`` (the expert count and MoE layers given or inferred); pickles are read by
``safe_pickle`` (values rebuilt by ``pickle_values``, torch's format in ``torch_format``). This
package imports ``harness.audit``'s layout, inputs and writer and ``harness.trace``; an importer
imports these shared modules, never another importer.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.audit.importers.model_shape import MOE_LAYERS_ENV, NUM_EXPERTS_ENV
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.audit.layout.writer import RunWriter

IMPORTERS = ("skyrl", "verl", "slime", "nemo_rl", "megatron_lm")
"""Every importer, by the name ``rrh audit --from`` takes."""


def importer(name: str) -> ModuleType:
    """The importer module called ``name`` (``LayoutError`` naming the known ones otherwise)."""
    if name not in IMPORTERS:
        raise LayoutError(f"--from {name!r}: expected one of {list(IMPORTERS)}")
    return importlib.import_module(f"harness.audit.importers.{name}")


def notes(
    name: str, *, num_experts: int | None = None, moe_layers: Sequence[int] | None = None
) -> tuple[str, ...]:
    """Importer ``name``'s ``NOTES``, one sentence each (a bare string is one sentence, never its letters),
    then its ``FACT_NOTES`` on each model fact the caller did not give: a note asking for
    ``--num-experts`` is untrue once it was given (by the argument, or by its environment variable where
    the importer reads it, ``FACTS_FROM_ENV``)."""
    module = importer(name)
    value = getattr(module, "NOTES", ())
    out = (value,) if isinstance(value, str) else tuple(value or ())
    from_env = bool(getattr(module, "FACTS_FROM_ENV", False))
    given = {
        "num_experts": num_experts is not None or (from_env and NUM_EXPERTS_ENV in os.environ),
        "moe_layers": moe_layers is not None or (from_env and MOE_LAYERS_ENV in os.environ),
    }
    facts: dict[str, str] = getattr(module, "FACT_NOTES", {})
    return out + tuple(note for fact, note in facts.items() if not given.get(fact, False))


def _owner(sources: Iterable[str]) -> ModuleType | None:
    """The importer that wrote every one of ``sources`` (``None``: none, or several)."""
    names = set()
    for source in sources:
        owner = None
        for name in IMPORTERS:
            try:
                module = importer(name)
            except ModuleNotFoundError:
                continue
            if source.startswith(tuple(getattr(module, "SOURCE_PREFIXES", ()))):
                owner = name
                break
        if owner is None:
            return None
        names.add(owner)
    return importer(names.pop()) if len(names) == 1 else None


def hints_for(sources: Iterable[str]) -> dict[str, str]:
    """The ``HINTS`` of the importer that wrote every one of ``sources`` (``{}``: none, or several)."""
    return dict(getattr(_owner(sources), "HINTS", {}))


def step_name_for(sources: Iterable[str]) -> str:
    """What a step is in the dump every one of ``sources`` came from, as its importer's ``STEP_NAME``
    says (slime's steps are rollout ids), else ``step``."""
    return str(getattr(_owner(sources), "STEP_NAME", "step"))


def detect(path: str | os.PathLike[str]) -> str | None:
    """The name of the importer whose dump ``path`` is, or ``None`` (a run layout, or nothing known)."""
    for name in IMPORTERS:
        try:
            if importer(name).detect(Path(path)):
                return name
        except ModuleNotFoundError:
            continue
    return None


SEARCH_DEPTH = 3
"""How many folders below the given one ``locate`` looks for a dump."""
SEARCH_DIRECTORIES = 5000
"""At most this many folders are looked into (a bound on the time a wrong folder costs)."""
EXPECTS = {
    "skyrl": "dumped_data/global_step_{N}_training_input.pkl (SkyRL trainer.dump_data_batch=true)",
    "verl": "{step}/gen_batch.dp (verl RolloutSkip: "
    "rollout_dump/{exp}_{project}/GBS{g}_N{n}_in{p}_out{r}/{step}/)",
    "slime": "rollout_data/{rollout_id}.pt or train_data/{rollout_id}.pt (slime --dump-details)",
    "nemo_rl": "train_data_step{N}.jsonl (NeMo-RL's log directory)",
    "megatron_lm": "router_trace_rank{r}.jsonl (Megatron-LM --moe-routing-trace-path)",
}
"""What each importer looks for, as ``locate``'s messages say it."""
RUN_LAYOUT = "*.parquet files of the run layout (rrh.run_layout in their metadata)"


def _detect_below(name: str, path: Path) -> bool:
    """``detect`` for a folder found below the given one: slime's own detection also takes any folder of
    numbered ``.pt`` files (a checkpoint folder looks like that), so below it only ``--dump-details``'
    ``rollout_data/`` or ``train_data/`` counts."""
    if name == "slime":
        return any(any((path / sub).glob("*.pt")) for sub in ("rollout_data", "train_data"))
    try:
        return bool(importer(name).detect(path))
    except ModuleNotFoundError:
        return False


def _has_layout(path: Path) -> bool:
    """Whether ``path`` is a Parquet file, or a folder with a run-layout file among its first Parquet files
    (read: their footers' ``rrh.run_layout`` key). A folder whose Parquet files are all something else
    (``rrh audit --summary`` tables, say) is not a run, so a dump below it may still be found."""
    if path.is_file():
        return path.suffix == ".parquet"
    if not path.is_dir():
        return False
    import itertools

    from harness.audit.layout.schema import METADATA_KEY

    files = list(itertools.islice((p for p in path.rglob("*.parquet") if p.is_file()), 16))
    if not files:
        return False
    import pyarrow.parquet as pq

    for file in files:
        try:
            metadata = pq.read_schema(file).metadata or {}
        except Exception:  # not Parquet: an input error of the audit, if the run layout is chosen
            continue
        if METADATA_KEY in metadata:
            return True
    return False


def _verl_runs(path: Path, loops: list[tuple[Path, Path]] | None = None) -> list[Path]:
    """The ``GBS…`` run folders of a verl dump root (steps of two runs would collide), each once: a
    symlink loop below it is not followed, and appended to ``loops``."""
    from harness.audit.importers import verl

    return sorted({f.parent.parent for f in verl.dump_files(path, loops)})


def _candidates(path: Path, names: tuple[str, ...]) -> tuple[list[tuple[str, Path]], int]:
    """``(importer, folder)`` of every dump within ``SEARCH_DEPTH`` folders below ``path`` (a folder taken
    as a dump is not looked into), and how many folders were looked at."""
    level, seen, found = [path], 0, []
    for _ in range(SEARCH_DEPTH):
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue
            below.extend(p for p in entries if p.is_dir() and not p.is_symlink() and p.name != ".git")
        below = below[: max(0, SEARCH_DIRECTORIES - seen)]
        seen += len(below)
        level = []
        for folder in below:
            hits = [(name, folder) for name in names if _detect_below(name, folder)]
            found += hits
            if not hits:
                level.append(folder)
        if not level:
            break
    return found, seen


def locate(path: str | os.PathLike[str], name: str | None = None) -> tuple[str | None, Path]:
    """What to audit at ``path``: ``(importer, dump)``, or ``(None, path)`` for the run layout.

    ``path`` itself when it is a dump (of ``name`` when given) or the run layout; else the one dump
    within ``SEARCH_DEPTH`` folders below it (an experiment folder holding ``rollout_dump/`` or
    ``export/``), one framework at a time. ``LayoutError`` naming both when two dumps (or two runs of
    one verl dump root) are found, or saying where it looked and what it expected when none is.
    """
    root = Path(path)
    if not root.exists():
        raise LayoutError(f"{root}: {_missing(root)}; expected a run directory or a framework's dump")
    if name is not None:
        importer(name)  # an unknown name is refused, naming the known ones
    names = IMPORTERS if name is None else (name,)
    found = [(n, root) for n in names if _detected(n, root)]
    if not found:
        if name is None and _has_layout(root):
            return None, root
        if root.is_file():
            if name is None:
                return None, root  # read as the run layout: the audit says what the file is not
            raise LayoutError(f"{root}: not a {name} dump; expected {EXPECTS.get(name, name)}")
        found, seen = _candidates(root, names)
        if not found:
            if name is None and any(root.rglob("*.parquet")):
                return None, root  # Parquet files, none of the run layout: the audit names each file
            expected = [EXPECTS.get(n, n) for n in names] + ([RUN_LAYOUT] if name is None else [])
            raise LayoutError(
                f"{root}: no run here: looked in it and up to {SEARCH_DEPTH} folder levels below ({seen} "
                f"folders) for {'; '.join(expected)}"
            )
    if len(found) > 1:
        listed = "; ".join(f"a {n} dump at {p}" for n, p in found)
        raise LayoutError(
            f"{root}: {len(found)} dumps found: {listed}; expected one: point at one of them"
            + ("" if name else " or give --from NAME")
        )
    chosen, dump = found[0]
    if chosen == "verl" and dump.is_dir():
        loops: list[tuple[Path, Path]] = []
        runs = _verl_runs(dump, loops)
        if len(runs) > 1:
            from harness.audit.importers import verl

            raise LayoutError(
                f"{dump}: {len(runs)} verl runs found: {runs[0]}; {runs[1]}"
                f"{'; …' if len(runs) > 2 else ''}; expected one (their steps would collide): point at one"
                + (f" ({verl.loop_note(loops, len(runs))})" if loops else "")
            )
    return chosen, dump


def _missing(path: Path) -> str:
    """Why ``path``, which ``Path.exists`` says is not there, is not: a symlink loop (``exists``
    answers ELOOP with False as for a missing file), a dangling link, or nothing of that name."""
    import errno

    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"a symlink loop ({os.strerror(errno.ELOOP)}, ELOOP): its links lead back to themselves"
        if err.errno == errno.ENOENT and os.path.islink(path):
            return f"a dangling symlink to {os.readlink(path)!r}: no such file or directory"
        if err.errno != errno.ENOENT:
            return err.strerror or type(err).__name__
    return "no such file or directory"


def _detected(name: str, path: Path) -> bool:
    try:
        return bool(importer(name).detect(path))
    except ModuleNotFoundError:
        return False


def import_dump(
    name: str,
    source: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    *,
    errors: list[str] | None = None,
    inferred: list[str] | None = None,
    notes: list[str] | None = None,
    **options: Any,
) -> list[Path]:
    """Convert the dump at ``source`` with importer ``name`` into run-layout files in ``directory``.

    ``options`` (``None`` values dropped) go to the importer's ``records``; one it does not take is
    refused, naming the importer, rather than silently ignored. What the importer inferred (model
    facts the dump does not record) is appended to ``inferred``, a line each. ``errors``: a list
    that collects one line per file that could not be imported while the others are (else the
    first one raises). ``notes``: what the importer says of the dump as it reads it (a symlink loop
    it did not follow), a line each.
    """
    module = importer(name)
    given = {k: v for k, v in options.items() if v is not None}
    accepted = inspect.signature(module.records).parameters
    unknown = sorted(k for k in given if k not in accepted)
    if unknown:
        raise LayoutError(f"--{unknown[0].replace('_', '-')}: the {name} importer does not take it")
    if errors is not None and "errors" in accepted:
        given["errors"] = errors
    if inferred is not None and "inferred" in accepted:
        given["inferred"] = inferred
    if notes is not None and "notes" in accepted:
        given["notes"] = notes
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
