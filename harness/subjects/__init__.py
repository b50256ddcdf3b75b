"""Subjects: the implementations under test (DESIGN §2 "subject").

A subject bundles whichever routing-replay pieces an implementation provides; the suites run the
invariants against each piece it has and skip, naming it, each piece it lacks. Select one with
``pytest --rr-subject package.module:object`` or the ``RR_SUBJECT`` environment variable.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from harness.errors import SubjectError

DEFAULT_SUBJECT = "harness.subjects.reference:REFERENCE"

CAPABILITIES = (
    "serving",
    "decode_payload",
    "splice",
    "truncate",
    "layouts",
    "install_replay",
    "install_hf_replay",
    "install_megatron_replay",
    "megatron_data",
    "training",
)
"""The pieces a subject may provide, in the order the suites exercise them."""


@dataclass(frozen=True)
class Subject:
    """An implementation under test. Every capability is optional.

    Attributes:
        name: how reports name the subject.
        serving: ``(model, *, prefill_chunk, prefix_block, speculative_tokens, ngram) -> engine``, a
            ``capabilities.ServedEngine`` for the reference ``MoELM`` (the engine side: what an engine
            captures under chunked prefill, a prefix route store, speculation and disaggregation).
        decode_payload: ``(engine, version, payload, **sample) -> RoutingTrace``.
        splice: ``(prompt_len, attempts) -> routes`` building one sample's trace from its attempts
            (``reference_impl.splice.Attempt``).
        truncate: ``(tokens, routes, prompt_len, max_response_len) -> (tokens, routes)``.
        layouts: any object with the functions of ``capabilities.LayoutsCapability``.
        install_replay: a ``capabilities.ReplayDriver`` (or a bare ``model -> ReplayController``
            callable) for the reference ``MoELM``.
        install_hf_replay: the same for a transformers MoE model (the SkyRL / FSDP path).
        install_megatron_replay: a ``capabilities.MegatronReplayDriver`` for Megatron-core models.
        megatron_data: a ``capabilities.MegatronDataMovement``: canonical routes ↔ one rank's routers.
        training: any object with the functions of ``capabilities.TrainingCapability``.

    Capability objects need not be hashable (a ``SimpleNamespace`` is fine); a member one lacks is
    a skip naming it (``capabilities.CapabilityView``).
    """

    name: str
    serving: Callable[..., Any] | None = None
    decode_payload: Callable[..., Any] | None = None
    splice: Callable[..., Any] | None = None
    truncate: Callable[..., Any] | None = None
    layouts: Any | None = None
    install_replay: Any | None = None
    install_hf_replay: Any | None = None
    install_megatron_replay: Any | None = None
    megatron_data: Any | None = None
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
    subject that cannot load is a usage error, never a crash and never a silent exit. The same
    holds for the attribute look-up: a module-level ``__getattr__`` may raise anything (a lazy
    dependency's ``ImportError``, a ``RuntimeError``), and that too is named, not a traceback.
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
    except (Exception, SystemExit) as err:  # a module-level __getattr__ failed otherwise
        raise SubjectError(
            f"looking up {attr!r} in module {module_name!r} raised {type(err).__name__}: {err}"
        ) from None
    if not isinstance(obj, Subject):
        raise SubjectError(
            f"{spec} is a {type(obj).__name__}, expected a harness.subjects.Subject "
            f"(with any of: {', '.join(CAPABILITIES)})"
        )
    return obj
