"""Released framework code under test: verl, SkyRL and Megatron-core, one subject per release.

Each module wraps one framework's own functions, as installed from PyPI, in thin signature
adapters: the release's code runs unchanged, only the engine call around it is replaced by a
canned one shaped exactly as that engine delivers it (the payload type is part of what each
subject declares). Modules import the framework lazily, when a capability is first called, so they
import without it; a subject whose release is not the installed one refuses to run, since its
verdict would describe other code.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import Any


class ReleaseMismatch(RuntimeError):
    """The subject wraps a release that is not the installed one (deliberately not a ValueError:
    no suite may mistake it for the subject rejecting bad input)."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a PyPI name), or ``None`` when it is absent."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_release(distribution: str, version: str, tox_env: str) -> None:
    """Raise ``ReleaseMismatch`` unless ``distribution==version`` is the installed release."""
    found = installed_version(distribution)
    if found != version:
        where = "is not installed" if found is None else f"is {found}"
        raise ReleaseMismatch(
            f"this subject wraps {distribution}=={version}, but {distribution} {where} "
            f"(run it in its env: tox -e {tox_env})"
        )


def check_placement_arguments(samples: Sequence[Any], width: int, prompt_lens: Sequence[int] | None) -> None:
    """The harness's own ``place_left_padded`` arguments, checked by an adapter before it maps them
    onto a release's API (which takes each sample's prompt and response apart and has no
    ``width`` or ``prompt_lens``); each sample's rows and routes go to the release as they are."""
    if not samples:
        raise ValueError("samples is empty: expected at least one (tokens, routes) sample")
    for index, (tokens, _) in enumerate(samples):
        if tokens.dim() != 1:
            raise ValueError(f"sample {index}: tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if tokens.shape[0] > width:
            raise ValueError(f"sample {index}: {tokens.shape[0]} tokens do not fit width {width}")
    if prompt_lens is not None and len(prompt_lens) != len(samples):
        raise ValueError(
            f"prompt_lens has {len(prompt_lens)} entries, expected one per sample ({len(samples)})"
        )
