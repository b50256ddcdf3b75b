"""The bug zoo: one mutant per public bug class (FACTS §4), to prove the suites catch each, and
benign variants (``harness.mutants.benign``): correct implementations that choose differently, to
prove the suites raise no false alarm.

A mutant is the reference subject with exactly one capability replaced by a copy that carries one
known bug, cited to the framework issue or PR where it shipped. ``rrh mutants``
(``harness.check.mutation``) runs the tests that declare the replaced capability against every mutant;
a mutant that survives is a hole in the suites.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from types import SimpleNamespace
from typing import Any

from harness.subjects import CAPABILITIES, Subject
from harness.subjects.reference import REFERENCE


@dataclass(frozen=True)
class Mutant:
    """A subject with one known bug.

    Attributes:
        name: short id; ``--rr-subject harness.mutants.registry:<name>`` selects it.
        bug_class: the FACTS §4 class it belongs to.
        instance: where the bug shipped (issue/PR), and when it hides (a boundary).
        subject: the reference with one capability replaced.
        killed_by: the suite invariant that catches the bug, as a test id under ``suites/``
            (``file.py::test`` or ``file.py::test[params]``). The default test run proves the kill
            with that invariant alone (seconds); ``rrh mutants`` runs every suite of the capability.
    """

    name: str
    bug_class: str
    instance: str
    subject: Subject
    killed_by: str

    @property
    def capability(self) -> str:
        """The one capability that differs from the reference."""
        changed = changed_capabilities(self.subject)
        if len(changed) != 1:
            raise AssertionError(
                f"mutant {self.name} must replace exactly one capability, replaces {changed}"
            )
        return changed[0]

    @property
    def subject_spec(self) -> str:
        """The ``--rr-subject`` spec that loads this mutant."""
        return f"harness.mutants.registry:{self.name}"


def changed_capabilities(subject: Subject) -> list[str]:
    """The capabilities in which ``subject`` differs from the reference (by identity)."""
    return [
        f.name
        for f in fields(Subject)
        if f.name in CAPABILITIES and getattr(subject, f.name) is not getattr(REFERENCE, f.name)
    ]


def mutate(name: str, **capability: Any) -> Subject:
    """The reference subject, named ``name``, with one capability replaced."""
    if len(capability) != 1:
        raise ValueError(f"mutate: replace exactly one capability, got {sorted(capability)}")
    return replace(REFERENCE, name=f"mutant:{name}", **capability)


def patched_module(module: Any, **functions: Any) -> SimpleNamespace:
    """A namespace with every public name of ``module``, a few of them replaced."""
    names = {n: getattr(module, n) for n in dir(module) if not n.startswith("_")}
    unknown = set(functions) - set(names)
    if unknown:
        raise ValueError(f"patched_module: {module.__name__} has no {sorted(unknown)}")
    return SimpleNamespace(**(names | functions))
