"""The version gate on the installed real vLLM (``rrh gate --engine vllm``, DESIGN §1, §4).

One observation of the installed vLLM (convention from real payloads, two runs' routes over the
tokens both produced, prefix-cache rows, agreement with the transformers trainer, the R3 gap;
``suites=False``: the suites themselves run beside this module) is compared with the committed
baseline of the newest release at or before it (``fixtures/baselines/vllm-<version>.json``): it
must pass; a copy of that baseline with one convention fact changed (the payload dtype, as if a
release had widened it) must fail with a diff naming the field; an observation whose two runs
parted (the figures vLLM does not promise) must pass with a note. Markers ``gpu`` and ``vllm``:
runs wherever vLLM can start.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from harness.gate import run as gate

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    return gate.observe("vllm", suites=False)


def _baseline(observed: dict[str, Any]) -> Path:
    path = gate.default_baseline("vllm", observed["version"])
    if not path.is_file():
        pytest.fail(
            f"no baseline at or before vLLM {observed['version']} in {path.parent}: record one with "
            "`rrh gate --engine vllm --update`"
        )
    return path


def test_gate_passes_against_the_recorded_baseline(observed: dict[str, Any]) -> None:
    out = io.StringIO()
    status = gate.run_gate("vllm", baseline=_baseline(observed), suites=False, observed=observed, stream=out)
    print(out.getvalue())
    assert status == 0, out.getvalue()


def test_gate_fails_against_a_tampered_baseline(observed: dict[str, Any], tmp_path: Path) -> None:
    doc = json.loads(_baseline(observed).read_text())
    tampered = copy.deepcopy(doc)
    tampered["convention"]["payload_dtype"] = "uint16"
    path = tmp_path / "vllm-tampered.json"
    path.write_text(json.dumps(tampered))
    out = io.StringIO()
    status = gate.run_gate("vllm", baseline=path, suites=False, observed=observed, stream=out)
    text = out.getvalue()
    assert status == 1, text
    assert "payload_dtype" in text and "uint8" in text and "uint16" in text, text


def test_two_runs_whose_tokens_part_pass_with_a_note(observed: dict[str, Any]) -> None:
    """What vLLM does not promise on CPU (FACTS §6): the observation of a machine where the two
    greedy runs parted (an AMX Xeon, a busy neighbour) passes the gate, the figures as notes."""
    recorded = json.loads(_baseline(observed).read_text())["figures"]
    parted = copy.deepcopy(observed)
    # Whatever this machine did, the opposite of what the baseline's machine did (one of them parted).
    parted["figures"]["engine.same_tokens_across_runs"]["value"] = (
        1.0 - recorded["engine.same_tokens_across_runs"]["value"]
    )
    parted["figures"]["engine.shared_token_fraction"]["value"] = (
        0.5 * recorded["engine.shared_token_fraction"]["value"]
    )
    out = io.StringIO()
    status = gate.run_gate("vllm", baseline=_baseline(observed), suites=False, observed=parted, stream=out)
    text = out.getvalue()
    assert status == 0, text
    assert (
        "figures.engine.same_tokens_across_runs" in text and "figures.engine.shared_token_fraction" in text
    ), text
    assert "not gated" in text and "REGRESSIONS" not in text, text
