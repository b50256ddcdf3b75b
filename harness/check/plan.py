"""What ``rrh check`` will run: a typed plan built from its options, before anything runs.

A ``CheckPlan`` lists the suite runs (``SuiteStep``: which suite files, which pytest marker and
keyword expressions), the mismatch labs (``LabStep``), the pytest arguments passed through, and
notes about what it leaves out. ``plan_check`` builds it and refuses a contradictory request with
``PlanError`` (the command line prints it in one line and exits 2); ``harness.cli.check_run``
executes it.

``family`` picks a transformers model type (``-k`` on the hf suites) or a router family (the
reference lab); which one is decided by the name.
"""

from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from harness.lab.measure import LabConfig

__all__ = [
    "DEFAULT_HF_FAMILY",
    "CheckPlan",
    "LabStep",
    "PlanError",
    "SuiteStep",
    "plan_check",
]

DEFAULT_HF_FAMILY = "qwen3_moe"
"""The transformers model type ``rrh check`` runs when no engine is named."""

LabKind = Literal["reference", "hf", "vllm", "sglang"]

REAL_ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
"""The real engines ``rrh check --engine`` drives: their suites (``suites/test_<engine>.py``) and lab."""

_HF_LAB_NOTE = (
    "The hf lab replays through the harness's own transformers hooks (harness.trainers.hf), "
    "not the subject's; the subject's hooks are checked by the transformers suites."
)
_LAB_NOTES: dict[LabKind, str] = {
    "reference": "",
    "hf": _HF_LAB_NOTE,
    **{
        engine: (
            f"Real {name} rollouts (sampled, temperature 1) vs the transformers trainer; R3 replayed "
            "through the hooks of subject '{subject}' (its install_hf_replay), the experts observed by "
            "the harness's probe."
        )
        for engine, name in REAL_ENGINES.items()
    },
}


class PlanError(Exception):
    """A contradictory or impossible ``rrh check`` request: printed as one line, exit status 2."""


@dataclass(frozen=True)
class SuiteStep:
    """One in-process pytest run over the suites: ``paths`` (None: every suite), ``-m select``,
    ``-k keyword``; ``engine`` is the backend the run exercises (reference, hf, vllm)."""

    name: str
    engine: str
    select: str
    paths: tuple[str, ...] | None = None
    keyword: str | None = None

    def selection(self) -> str:
        """The run as a pytest selection a reader can retype (``suites/test_x.py -m '…' -k …``; a
        conformance test file as ``conformance/test_x.py``)."""
        files = [f"{Path(p).parent.name}/{Path(p).name}" for p in self.paths] if self.paths else ["suites/"]
        keyword = ["-k", shlex.quote(self.keyword)] if self.keyword else []
        return " ".join([*files, "-m", shlex.quote(self.select), *keyword])


@dataclass(frozen=True)
class LabStep:
    """One mismatch lab: ``kind`` picks the rollouts (reference engine, transformers, real vLLM)."""

    kind: LabKind
    config: LabConfig

    @property
    def title(self) -> str:
        return f"{self.kind} mismatch lab ({self.config.family})"

    @property
    def capability(self) -> str:
        """The subject capability the lab replays through."""
        return "install_replay" if self.kind == "reference" else "install_hf_replay"

    def note(self, subject: str) -> str:
        """What the report says under the lab: whose hooks it replayed through (``subject``: its name)."""
        return _LAB_NOTES[self.kind].format(subject=subject)


@dataclass(frozen=True)
class CheckPlan:
    """Everything ``rrh check`` will run against ``subject`` (``MODULE:ATTR``)."""

    subject: str
    engine: str | None
    family: str | None
    suites: tuple[SuiteStep, ...]
    labs: tuple[LabStep, ...]
    pytest_args: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def titles(self) -> list[str]:
        """The suite runs and labs by name, in order (the header line)."""
        return [s.name for s in self.suites] + [lab.title for lab in self.labs]


def _hf_families() -> list[str]:
    from harness.trainers.hf.models import MODEL_TYPES

    return list(MODEL_TYPES)


def lab_config(kind: LabKind, family: str | None) -> LabConfig:
    """The lab's configuration: the default lab, or its router family (reference) / Qwen3-MoE."""
    from harness.lab.measure import LabConfig
    from reference_impl import ROUTER_FAMILIES

    if kind != "reference":
        return LabConfig(family=DEFAULT_HF_FAMILY)
    return LabConfig(family=family) if family is not None and family in ROUTER_FAMILIES else LabConfig()


def plan_check(
    *,
    subject: str,
    engine: str | None = None,
    family: str | None = None,
    suites: Sequence[str] = (),
    run_suites: bool = True,
    lab: bool = True,
    select: str | None = None,
    distributed: bool = False,
    pytest_args: Sequence[str] = (),
) -> CheckPlan:
    """The plan of ``rrh check`` with these options (their meaning: ``rrh check --help``).

    ``suites``: suite names (``splice`` → ``suites/test_splice.py``), empty for every suite;
    ``run_suites=False``: the labs only. ``PlanError`` when the request cannot be run here or
    contradicts itself (a family of the wrong kind, an engine that cannot start).
    """
    from harness.check.suites import conformance_dir, suites_dir
    from reference_impl import ROUTER_FAMILIES

    steps: list[SuiteStep] = []
    labs: list[LabStep] = []
    notes: list[str] = []
    kind = engine or "default"
    marks = select or "not slow and not gpu"
    if select is None and not distributed:
        marks += " and not distributed"
        if kind in ("default", "reference"):
            notes.append(
                "The distributed suites (real torch.distributed process groups; minutes on a few CPU "
                "cores) were not run: add --distributed."
            )
    hf_family = family if family in _hf_families() else None
    router_family = family if family in ROUTER_FAMILIES else None
    suite_paths = tuple(str(suites_dir() / f"test_{name}.py") for name in suites) if suites else None
    # the transformers suites, and the conformance tests of the harness's own transformers engine
    hf_paths: tuple[str, ...] = (
        str(suites_dir() / "test_hf.py"),
        str(conformance_dir() / "test_hf_engine.py"),
    )
    if suite_paths and not any(p.endswith("test_hf.py") for p in suite_paths):
        hf_paths = ()
    has_transformers = importlib.util.find_spec("transformers") is not None
    if kind in ("default", "reference"):
        ref_paths = tuple(p for p in suite_paths if not p.endswith("test_hf.py")) if suite_paths else None
        if ref_paths is None or ref_paths:
            steps.append(SuiteStep("reference suites", "reference", f"not hf and ({marks})", ref_paths))
        if lab:
            labs.append(LabStep("reference", lab_config("reference", family)))
    if kind in ("default", "hf"):
        keyword = hf_family or (DEFAULT_HF_FAMILY if kind == "default" else None)
        name = f"transformers suites ({keyword})" if keyword else "transformers suites (every family)"
        if not has_transformers:
            notes.append(f"The {name} were not run: transformers is not installed (pip install -e '.[hf]').")
        elif hf_paths:
            steps.append(SuiteStep(name, "hf", f"hf and ({marks})", hf_paths, keyword))
        if kind == "hf" and lab and has_transformers:
            labs.append(LabStep("hf", lab_config("hf", family)))
    if kind in REAL_ENGINES:
        from harness.engines.hints import cpu_hint
        from harness.engines.installed import start_blocker

        blocker = start_blocker(kind)
        if blocker is not None:
            hint = cpu_hint(kind)
            cpu = "" if hint in blocker else f"; on CPU: {hint}"
            raise PlanError(f"--engine {kind}: {blocker}{cpu}; or run on a GPU runner")
        suite = (str(suites_dir() / f"test_{kind}.py"),)
        steps.append(SuiteStep(f"{REAL_ENGINES[kind]} engine suites", kind, kind, suite))
        if lab:
            labs.append(LabStep(kind, lab_config(kind, family)))
    if family and not hf_family and not router_family:
        raise PlanError(
            f"--family {family!r} is neither a transformers model type ({', '.join(_hf_families())}) "
            f"nor a router family of the reference lab ({', '.join(ROUTER_FAMILIES)})"
        )
    if kind == "hf" and router_family:
        raise PlanError(
            f"--engine hf --family takes a transformers model type ({', '.join(_hf_families())}); "
            f"{family!r} is a router family of the reference lab"
        )
    if kind == "reference" and hf_family:
        raise PlanError(
            f"--engine reference --family takes a router family ({', '.join(ROUTER_FAMILIES)}); "
            f"{family!r} is a transformers model type (use --engine hf)"
        )
    if not run_suites:
        notes.append("The suites were not run (--no-suites): the mismatch lab only.")
        steps = []
    return CheckPlan(subject, engine, family, tuple(steps), tuple(labs), tuple(pytest_args), tuple(notes))
