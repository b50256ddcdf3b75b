"""Released framework code under test: verl, SkyRL and Megatron-core, one subject per release.

Each module wraps one framework's own functions, as installed from PyPI, in thin signature
adapters: the release's code runs unchanged, only the engine call around it is replaced by a
canned one shaped exactly as that engine delivers it (the payload type is part of what each
subject declares). Modules import the framework lazily, when a capability is first called, so they
import without it; a subject whose release is not the installed one refuses to run, since its
verdict would describe other code.
"""

from __future__ import annotations

from importlib import metadata


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
