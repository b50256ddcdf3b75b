"""The subject seam: capability protocols, patch isolation, and probes that do not take a subject's word."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.mutants.registry import get
from harness.probes.reference import attach
from harness.subjects import Subject
from harness.subjects import replay as seam
from harness.subjects.capabilities import (
    CapabilityView,
    LayoutsCapability,
    MissingMember,
    ReplayController,
    ReplayDriver,
    TrainingCapability,
    as_driver,
    missing_members,
)
from harness.subjects.reference import REFERENCE
from harness.testing.asserts import assert_same_routes, differing_routes
from harness.trainers.kinds import reference_kind
from tests.inprocess import run_pytest


def test_reference_capabilities_satisfy_their_protocols() -> None:
    assert missing_members(REFERENCE.layouts, LayoutsCapability) == []
    assert missing_members(REFERENCE.training, TrainingCapability) == []
    assert isinstance(as_driver(REFERENCE.install_replay), ReplayDriver)


def test_a_missing_member_names_itself() -> None:
    view = CapabilityView(SimpleNamespace(sp_shard=len), "layouts", "mine")
    assert view.sp_shard is len
    with pytest.raises(
        MissingMember, match=r"subject 'mine': layouts \(LayoutsCapability\) has no member 'pack'"
    ):
        view.pack  # noqa: B018


def test_a_controller_missing_a_member_is_named_at_install() -> None:
    class NoBackward:
        def record(self) -> None: ...
        def recording(self) -> torch.Tensor: ...
        def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None: ...
        def disarm(self) -> None: ...

    assert not isinstance(NoBackward(), ReplayController)
    with pytest.raises(MissingMember, match="'prepare_backward'"):
        seam.install(lambda model: NoBackward(), torch.nn.Linear(1, 1))


def test_unhashable_capabilities_are_accepted() -> None:
    subject = Subject("ns", layouts=SimpleNamespace(**vars(REFERENCE.layouts)))
    assert subject.capabilities() == ["layouts"]


class _Patching:
    """A driver whose patch is a global flag, with or without ``unpatch``."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def patch(self) -> None:
        self.log.append(f"patch {self.name}")

    def install(self, model: object) -> object:
        return REFERENCE.install_replay(model)


class _Undoable(_Patching):
    def unpatch(self) -> None:
        self.log.append(f"unpatch {self.name}")


def test_patch_runs_once_and_is_undone_at_session_end(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seam, "_patched", [])
    log: list[str] = []
    driver = _Undoable(log, "a")
    model = reference_kind().build("softmax_topk", "fp32")
    for _ in range(2):
        with seam.controlled(driver, model):
            pass
    seam.unpatch_all()
    assert log == ["patch a", "unpatch a"]


def test_a_patch_that_cannot_be_undone_refuses_a_second_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seam, "_patched", [])
    log: list[str] = []
    model = reference_kind().build("softmax_topk", "fp32")
    seam.install(_Patching(log, "stuck"), model)
    with pytest.raises(seam.PatchIsolationError, match="own process"):
        seam.install(_Undoable(log, "next"), model)


def test_a_patch_that_cannot_be_undone_admits_a_driver_that_patches_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare ``model -> controller`` callable patches nothing: a stuck driver is no reason to refuse it."""
    monkeypatch.setattr(seam, "_patched", [])
    log: list[str] = []
    model = reference_kind().build("softmax_topk", "fp32")
    seam.install(_Patching(log, "stuck"), model)
    seam.install(REFERENCE.install_replay, model).disarm()
    assert log == ["patch stuck"]


@pytest.mark.parametrize("name", ["claims-replay-without-arming", "stale-router-objects"])
def test_probe_only_mutants_report_success_while_the_probe_sees_native_routing(name: str) -> None:
    """The new mutants lie convincingly: their own ``dispatched()`` equals the targets; the probe does not."""
    kind = reference_kind()
    model = kind.build("softmax_topk", "fp32")
    kind.negate_routers(model)
    handle = seam.install(get(name).subject.install_replay, model)
    probe = attach(model)
    routing = kind.routing(model)
    targets = torch.arange(routing.top_k).expand(12, len(routing.moe_layers), routing.top_k).clone()
    handle.replay(targets)
    with torch.no_grad():
        kind.run(model, torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0)))
    assert_same_routes(handle.dispatched(), targets, names=("the mutant's own report", "targets"))  # type: ignore[attr-defined]
    assert bool(differing_routes(probe.last().ids, targets).any()), "the probe saw the targets dispatched"
    seam.teardown(handle)


def test_a_subject_with_a_namespace_missing_a_layout_function_skips_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "partial_subject.py").write_text(
        "from types import SimpleNamespace\n"
        "from reference_impl import layouts\n"
        "from harness.subjects import Subject\n"
        "names = {n: getattr(layouts, n) for n in dir(layouts) if n[0] != '_' and n != 'sp_shard'}\n"
        "PARTIAL = Subject(name='partial', layouts=SimpleNamespace(**names))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_pytest(
        "-q", "-rs", "suites/test_layouts.py", "--rr-subject", "partial_subject:PARTIAL", "-k", "sp"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "has no member 'sp_shard'" in run.stdout, run.stdout


def test_isolation_counts_what_the_subjects_driver_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver that declares it patches nothing (Megatron-core's own replay) is admitted after a stuck
    patch and refuses nobody; the replay suite's Megatron wrapper says what the subject's driver says,
    and offers ``unpatch`` exactly when that driver has one."""
    from harness.testing.megatron_kind import MegatronKindDriver
    from harness.trainers.megatron.subject import MEGATRON_DATA, HarnessMegatronDriver

    monkeypatch.setattr(seam, "_patched", [])
    log: list[str] = []
    model = reference_kind().build("softmax_topk", "fp32")
    seam.install(_Patching(log, "stuck"), model)
    kind = MegatronKindDriver(HarnessMegatronDriver(), MEGATRON_DATA)
    assert not seam.patches(kind)
    seam.ensure_patched(kind)  # not refused
    assert seam._patched == [seam._patched[0]] and len(seam._patched) == 1
    assert not isinstance(kind, seam.Unpatchable)
    stuck = MegatronKindDriver(_Patching(log, "megatron"), MEGATRON_DATA)
    assert seam.patches(stuck) and not isinstance(stuck, seam.Unpatchable)
    undoable = MegatronKindDriver(_Undoable(log, "megatron"), MEGATRON_DATA)
    assert isinstance(undoable, seam.Unpatchable)
    undoable.unpatch()
    assert log[-1] == "unpatch megatron"
