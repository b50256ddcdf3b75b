"""The layering (DESIGN §4): every import of the project's own modules points down, or stays in its
layer, and no modules import each other (no circle, however long).

Each module of ``reference_impl/``, ``harness/``, ``suites/`` and ``conformance/`` is parsed (not
imported) and every ``import`` in it is read, those inside functions and under ``TYPE_CHECKING``
included: an import moved into a function to dodge the layering or a circle still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference_impl", "harness", "suites", "conformance")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reference implementation", ("reference_impl",)),
    (
        "core",
        (
            "harness",  # the package itself: its version and error types
            "harness.errors",
            "harness.atomic",
            "harness.trace",  # the package and its modules (routing_trace, kernels, storage, comparison)
            "harness.conventions",
            "harness.metrics",
            "harness.outcomes",
            "harness.cpus",
            "harness.lab.measure",  # the mismatch lab's measurement: any engine's rollouts scored
            "harness.table",
            "harness.strategies",
            "harness.schedules",
            "harness.gate.baseline",  # a baseline document and its comparison
        ),
    ),
    ("engines and trainers", ("harness.engines", "harness.trainers", "harness.probes")),
    (
        "subjects",
        (
            "harness.subjects",
            "harness.mutants",
            "harness.lab",  # the lab run on the reference engine and on a real one, with a subject
            "harness.run",  # rrh run: a real RL loop and its trainer ranks, written through the tap
            # the gate's view of each engine: the reference adapter runs the reference lab (harness.lab),
            # so the adapters sit here, above the engines they wrap
            "harness.gate.adapters",
            # the audit of real runs sits beside the subjects: it reads runs, it never runs suites
            "harness.audit",
        ),
    ),
    ("test support", ("harness.testing",)),
    ("suites and suite runner", ("suites", "harness.check", "harness.verdicts")),
    (
        "cli, pytest plugin, reports",
        (
            "harness.cli",  # one module per command
            "harness.__main__",
            "harness.pytest_plugin",
            "harness.report",
            "harness.gate",  # rrh gate: an engine observed and compared with its baseline
            "harness.bench",  # every rrh bench target
            "conformance",  # the harness's own backends and tools checked: the gate included
        ),
    ),
)
"""Bottom to top. A name covers the module of that name, its submodules, and modules named with it
and an underscore (``harness.trace`` covers ``harness.trace_io``); the longest name wins."""


def layer_of(module: str) -> int | None:
    """The index in ``LAYERS`` of ``module``'s layer, or ``None`` when no name covers it."""
    best: tuple[int, int] | None = None  # (length of the covering name, layer)
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "harness" and module.startswith((f"{name}.", f"{name}_")))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` of one of ``PACKAGES`` (relative ones resolved)."""
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


def _from_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a ``from … import`` statement in ``module`` reads from (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, name)`` of every import in ``source`` (the text of ``module``) of one of ``PACKAGES``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source_module = _from_module(node, module, is_package)
            # ``from harness import lab`` imports the module harness.lab, not only the package.
            found += [(node.lineno, source_module)]
            found += [
                (node.lineno, f"{source_module}.{alias.name}") for alias in node.names if alias.name != "*"
            ]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _is_module(name: str) -> bool:
    """Whether ``name`` is one of the project's modules or packages (not a name inside a module)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_targets(source: str, module: str, is_package: bool = False) -> set[str]:
    """The project's modules ``source`` (the text of ``module``) imports, each by its own name:
    ``from a.b import c`` names the module ``a.b.c`` when there is one, else ``a.b`` (``c`` is a
    name in it); ``import a.b`` names ``a.b``. Parent packages that Python initialises on the way
    are not named: a circle through a package's ``__init__`` shows when a name is taken from it."""
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, module, is_package)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.add(child if alias.name != "*" and _is_module(child) else base)
    return {t for t in targets if t.split(".")[0] in PACKAGES and _is_module(t) and t != module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module of ``graph`` (module → the modules
    it imports), each sorted: every group of modules that import each other, directly or round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_has_a_layer() -> None:
    missing = [module_name(p) for p in _sources() if layer_of(module_name(p)) is None]
    assert not missing, f"modules in no layer (add them to LAYERS, and to DESIGN §4): {missing}"


def test_every_import_points_down_or_stays_in_its_layer() -> None:
    upward = []
    for path in _sources():
        here = layer_of(module_name(path))
        if here is None:
            continue  # reported by the test above
        for line, name in imports_of(path):
            target = layer_of(name)
            if _is_module(name) and target is not None and target > here:
                where = f"{path.relative_to(ROOT)}:{line} ({LAYERS[here][0]})"
                upward.append(f"{where} imports {name} ({LAYERS[target][0]})")
    assert not upward, "imports pointing up the layering:\n" + "\n".join(upward)


@pytest.mark.parametrize(
    "source",
    [
        "from harness.check.suites import run_suites\n",
        "def f():\n    from harness.check import suites\n",
        "from ...check import suites\n",
    ],
)
def test_an_upward_import_is_found_even_inside_a_function(source: str) -> None:
    """The check can fail: a trainer module importing the suite runner, at the top, lazily or relatively."""
    module = "harness.trainers.hf.example"
    names = [name for _, name in imports_in(source, module)]
    assert "harness.check.suites" in names and _is_module("harness.check.suites")
    assert layer_of(module) < layer_of("harness.check.suites")  # type: ignore[operator]


def test_no_modules_import_each_other() -> None:
    graph = {
        module_name(p): import_targets(p.read_text(), module_name(p), p.name == "__init__.py")
        for p in _sources()
    }
    found = circles(graph)
    assert not found, (
        "modules that import each other (one concept split wrong, or a callback that wants a protocol):\n"
        + "\n".join(" ↔ ".join(c) for c in found)
    )


TYPES_ONLY = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        # a lazy import closing the loop, as harness/cli.py ↔ harness/gate/run.py had
        (
            {
                "harness.cli": "from harness.gate.run import add_parser\n",
                "harness.gate.run": "def main():\n    from harness.cli import main\n",
            },
            [["harness.cli", "harness.gate.run"]],
        ),
        # an import for types only, as harness/report/document.py ↔ harness/report/verdict.py had
        (
            {
                "harness.report.document": "from harness.report.verdict import verdict\n",
                "harness.report.verdict": TYPES_ONLY
                + "    from harness.report.document import CheckReport\n",
            },
            [["harness.report.document", "harness.report.verdict"]],
        ),
        # round three modules, one relative
        (
            {
                "harness.cli.gate": "from harness.gate import run\n",
                "harness.gate.run": "from harness.check.suites import run_suites\n",
                "harness.check.suites": "from ..cli import gate\n",
            },
            [["harness.check.suites", "harness.cli.gate", "harness.gate.run"]],
        ),
        # a name taken from a package whose __init__ imports nothing back: no circle
        (
            {"harness.cli": "from harness import __version__\n", "harness.gate.run": "import harness.cli\n"},
            [],
        ),
    ],
)
def test_a_circle_is_found_lazy_or_for_types_or_round_a_loop(
    sources: dict[str, str], expected: list[list[str]]
) -> None:
    """The check can fail: each circle the project had, and a longer one, are found; a chain is not."""
    graph = {module: import_targets(text, module) for module, text in sources.items()}
    assert circles(graph) == expected


def import_first_candidates(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` (module → the modules it imports, lazily included) that can meet a
    half-built module when imported first: the members of its circles once every module also points
    at its parent package (Python initialises ``a`` and ``a.b`` before ``a.b.c``).

    A circular import fails only inside such a circle, and the modules inside it run the same way
    whichever module outside it led there (what it leads to outside cannot lead back), as when the
    first of them to start is imported first: importing the members first covers every module. The
    graph over-approximates (every import statement counts), so it may only add members."""
    with_parents = {
        module: targets | ({module.rpartition(".")[0]} if "." in module else set())
        for module, targets in graph.items()
    }
    return sorted({module for circle in circles(with_parents) for module in circle})


def test_every_module_imports_first_in_a_process() -> None:
    """A package ``__init__`` that re-exports can close a circle no pair of modules shows (importing
    ``harness.probes.hf`` first once hit a half-built module through ``harness.trainers.hf``): each
    module that can meet one (``import_first_candidates``: the members of the package circles, ~70 of
    ~200 modules) is imported with no ``harness`` module loaded before it, in one fresh interpreter."""
    import subprocess
    import sys

    graph = {
        module_name(p): import_targets(p.read_text(), module_name(p), p.name == "__init__.py")
        for p in _sources()
        if module_name(p).startswith("harness") and module_name(p) != "harness.__main__"
    }
    names = import_first_candidates(graph)
    assert {"harness.cli.check", "harness.trainers.hf.replay", "harness.trace"} <= set(names), names
    assert "harness.cli.reference" not in names  # imported by no module: nothing can lead back to it
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'harness' or m.startswith('harness.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as err:\n"
        "        if 'circular import' in str(err) or 'partially initialized' in str(err):\n"
        "            print(f'{name}: {err}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not done.stdout.strip(), f"modules that circle back when imported first:\n{done.stdout}"


# --- the house: folders that show the architecture (issue 36) ------------------------------------

TOP_LEVEL_LIMIT = 10
"""Modules at ``harness/``'s top level: the shared leaves (errors, atomic writes, tables, outcomes,
CPUs, strategies, the simulated engine), the package, ``python -m harness`` and the pytest plugin;
every other concern is a package."""

LINES_LIMIT = 450
"""Lines of any one module of the library (``harness/``)."""


def test_harness_top_level_holds_only_the_shared_leaves() -> None:
    modules = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert len(modules) <= TOP_LEVEL_LIMIT, (
        f"{len(modules)} modules at harness/'s top level, at most {TOP_LEVEL_LIMIT} expected (a concern "
        f"of its own is a package): {modules}"
    )


def test_no_module_is_longer_than_the_limit() -> None:
    long = sorted(
        (len(p.read_text().splitlines()), str(p.relative_to(ROOT)))
        for p in (ROOT / "harness").rglob("*.py")
        if len(p.read_text().splitlines()) > LINES_LIMIT
    )
    assert not long, f"modules over {LINES_LIMIT} lines (split along a seam): {long}"


def test_every_package_says_what_it_is_for() -> None:
    """Each package of ``harness/`` opens with a docstring naming its concern."""
    silent = [
        str(init.parent.relative_to(ROOT))
        for init in sorted((ROOT / "harness").rglob("__init__.py"))
        if not (ast.get_docstring(ast.parse(init.read_text())) or "").strip()
    ]
    assert not silent, f"packages without a docstring saying what they are for: {silent}"


@pytest.mark.parametrize(
    ("source", "upward"),
    [
        ("from harness.trainers.megatron.layout import MegatronLayout\n", False),  # same layer
        ("from harness.cli.audit_run import run_audit\n", True),  # the top, from the engines
        ("def f():\n    from harness.gate.run import run_gate\n", True),  # lazily, still upward
        ("from harness.gate.baseline import metric\n", False),  # the core half of a split package
    ],
)
def test_a_lower_layer_never_imports_a_higher_one_inside_split_packages(source: str, upward: bool) -> None:
    """Packages whose modules sit on different floors (``gate``: its baseline is core, its run the
    top) are judged module by module: a probe may import the baseline, never the gate's run."""
    module = "harness.probes.megatron"
    here = layer_of(module)
    assert here is not None
    targets = [layer_of(name) for _, name in imports_in(source, module) if _is_module(name)]
    assert any(t is not None and t > here for t in targets) is upward
