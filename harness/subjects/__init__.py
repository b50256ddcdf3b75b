"""Subjects: the implementations under test (DESIGN §2 "subject").

A subject bundles whichever routing-replay pieces an implementation provides; the suites run the
invariants against each piece it has and skip, naming it, each piece it lacks. Select one with
``pytest --rr-subject package.module:object`` or the ``RR_SUBJECT`` environment variable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from harness.errors import SubjectError

DEFAULT_SUBJECT = "harness.subjects.reference:REFERENCE"

CAPABILITIES = (
    "decode_payload",
    "splice",
    "truncate",
    "layouts",
    "install_replay",
    "install_hf_replay",
    "training",
)
"""The pieces a subject may provide, in the order the suites exercise them."""


class ReplayHandle(Protocol):
    """Record/replay control over one model's routers, as a subject implements it.

    Routes are ``[tokens, num_moe_layers, top_k]`` in the model's token order (row ``b·T + t``),
    MoE layers in model order. Megatron-core's ``RouterReplay`` actions map onto these methods.
    """

    def record(self) -> None:
        """Route natively on the next forward and keep the chosen ids."""

    def recording(self) -> torch.Tensor:
        """The ids chosen by the recorded forward; stops recording."""

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Force ``targets`` on every later forward (rows where ``mask`` is False route natively)."""

    def prepare_backward(self) -> None:
        """Before backward: activation recompute must replay what each forward used (a FIFO)."""

    def dispatched(self) -> torch.Tensor:
        """The ids the experts actually received in the last forward."""

    def disarm(self) -> None:
        """Back to native routing; drop targets, queues and recordings."""


@dataclass(frozen=True)
class Subject:
    """An implementation under test. Every capability is optional.

    Attributes:
        name: how reports name the subject.
        decode_payload: ``(engine, version, payload, **sample) -> RoutingTrace``.
        splice: ``(prompt_len, attempts) -> routes`` building one sample's trace from its attempts
            (``reference_impl.splice.Attempt``).
        truncate: ``(tokens, routes, prompt_len, max_response_len) -> (tokens, routes)``.
        layouts: an object with the layout functions of ``reference_impl.layouts``.
        install_replay: ``(model) -> ReplayHandle``: record/replay control over a model's routers.
        install_hf_replay: ``(transformers model) -> ReplayHandle``: the same control over a
            transformers MoE model (hooks on its routers; the SkyRL / FSDP path).
        training: an object with the trainer passes of ``reference_impl.training`` (``check_mode``,
            ``reference_logprobs``, …): the R2/R3 configuration rules and the reference pass.
    """

    name: str
    decode_payload: Callable[..., Any] | None = None
    splice: Callable[..., Any] | None = None
    truncate: Callable[..., Any] | None = None
    layouts: Any | None = None
    install_replay: Callable[..., Any] | None = None
    install_hf_replay: Callable[..., Any] | None = None
    training: Any | None = None

    def capabilities(self) -> list[str]:
        """Names of the capabilities this subject provides."""
        return [f.name for f in fields(self) if f.name in CAPABILITIES and getattr(self, f.name) is not None]

    def require(self, capability: str) -> Any:
        """The capability, or ``MissingCapability`` naming it when this subject does not provide it."""
        value = getattr(self, capability, None)
        if value is None:
            raise MissingCapability(f"subject {self.name!r} does not provide {capability!r}")
        return value


class MissingCapability(LookupError):
    """A suite needs a capability the subject under test does not provide (the test is skipped)."""


def load_subject(spec: str) -> Subject:
    """Import ``module:attr`` and check that it is a ``Subject``; raise ``SubjectError`` otherwise.

    Whatever importing the module raises (``ImportError``, a ``SyntaxError`` in it, any exception
    of its top-level code, even ``SystemExit``) becomes a ``SubjectError`` naming the module: a
    subject that cannot load is a usage error, never a crash and never a silent exit.
    """
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not attr or not all(part.isidentifier() for part in module_name.split(".")):
        raise SubjectError(f"expected 'package.module:object' (an absolute module path), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SubjectError(
            f"cannot import module {module_name!r} ({err}); it is looked up on sys.path "
            "(the current directory included)"
        ) from None
    except SyntaxError as err:
        raise SubjectError(
            f"module {module_name!r} has a syntax error: {err.msg} ({err.filename}, line {err.lineno})"
        ) from None
    except (Exception, SystemExit) as err:  # the module's own code failed, or exited, while importing
        raise SubjectError(f"importing module {module_name!r} raised {type(err).__name__}: {err}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise SubjectError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, Subject):
        raise SubjectError(
            f"{spec} is a {type(obj).__name__}, expected a harness.subjects.Subject "
            f"(with any of: {', '.join(CAPABILITIES)})"
        )
    return obj
