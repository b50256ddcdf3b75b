"""The version gate on the installed real engine (``rrh gate --engine vllm|sglang``, DESIGN §1, §4).

One observation of the installed engine (convention from real payloads, two runs' routes over the
tokens both produced, prefix-cache rows, agreement with the transformers trainer, the R3 gap;
``suites=False``: the suites themselves run beside this module) is compared with the committed
baseline of the newest release at or before it (``fixtures/baselines/<engine>-<version>.json``): it
must pass; a copy of that baseline with one convention fact changed (the payload dtype, as if a
release had widened it) must fail with a diff naming the field; an observation whose two runs
parted (the figures neither engine promises on CPU) must pass with a note. Markers ``gpu`` and the
engine's (``vllm``/``sglang``): runs wherever that engine can start.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import pytest

from harness.gate import run as gate

ENGINES = [
    pytest.param("vllm", marks=[pytest.mark.gpu, pytest.mark.vllm], id="vllm"),
    pytest.param("sglang", marks=[pytest.mark.gpu, pytest.mark.sglang], id="sglang"),
]
pytestmark = pytest.mark.parametrize("engine_name", ENGINES, scope="module")


@pytest.fixture(scope="module")
def observed(engine_name: str) -> dict[str, Any]:
    return gate.observe(engine_name, suites=False)


def _baseline(observed: dict[str, Any]) -> Path:
    engine = observed["engine"]
    path = gate.default_baseline(engine, observed["version"])
    if not path.is_file():
        pytest.fail(
            f"no baseline at or before {engine} {observed['version']} in {path.parent}: record one with "
            f"`rrh gate --engine {engine} --update`"
        )
    return path


def test_gate_passes_against_the_recorded_baseline(observed: dict[str, Any]) -> None:
    out = io.StringIO()
    status = gate.run_gate(
        observed["engine"], baseline=_baseline(observed), suites=False, observed=observed, stream=out
    )
    print(out.getvalue())
    assert status == 0, out.getvalue()


def test_gate_fails_against_a_tampered_baseline(observed: dict[str, Any], tmp_path: Path) -> None:
    doc = json.loads(_baseline(observed).read_text())
    tampered = copy.deepcopy(doc)
    recorded = doc["convention"]["payload_dtype"]
    tampered["convention"]["payload_dtype"] = "uint16" if recorded != "uint16" else "int64"
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(tampered))
    out = io.StringIO()
    status = gate.run_gate(observed["engine"], baseline=path, suites=False, observed=observed, stream=out)
    text = out.getvalue()
    assert status == 1, text
    assert "payload_dtype" in text and recorded in text and tampered["convention"]["payload_dtype"] in text, (
        text
    )


def test_two_runs_whose_tokens_part_pass_with_a_note(observed: dict[str, Any]) -> None:
    """What neither engine promises on CPU (FACTS §6): the observation of a machine where the two
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
    status = gate.run_gate(
        observed["engine"], baseline=_baseline(observed), suites=False, observed=parted, stream=out
    )
    text = out.getvalue()
    assert status == 0, text
    assert (
        "figures.engine.same_tokens_across_runs" in text and "figures.engine.shared_token_fraction" in text
    ), text
    assert "not gated" in text and "REGRESSIONS" not in text, text
