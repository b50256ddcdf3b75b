"""Bad input from outside never escapes as a foreign exception and never exhausts memory.

Every entry point that reads outside data — trace files and the ``RoutingTrace`` constructor,
gate baselines, the engines' HTTP responses, subject specs — is fed generated inputs aimed at the
classes that once leaked (issue 17): declared sizes far beyond the data (``num_layers: 2**40``),
deep nesting, non-finite and huge numbers, values of the wrong type, bytes that are not UTF-8.
Each must return a valid result or raise the project's own error (``HarnessError``).

A memory cap (``RLIMIT_AS`` a fixed margin above the process's current address space, for the
duration of one test) makes an allocation bomb fail its test with ``MemoryError`` instead of
taking the machine down. Each test reports how many inputs it generated (``-s`` prints them;
they are also recorded as the test's ``inputs`` property).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import resource
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.conventions import ModelSpec, encode_sglang_b64
from harness.engines import http
from harness.errors import HarnessError
from harness.gate import baseline as bl
from harness.gate.compare import compare as gate_compare
from harness.subjects import Subject, load_subject
from harness.trace import Provenance, RoutingTrace

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 1 << 30
"""Address space a test may add to what the process already has: far above what the inputs
justify (kilobytes), far below what a bomb asks for (the 400-byte file once asked for 23 GB)."""

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


def _address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def memory_cap(margin: int = MARGIN) -> Iterator[None]:
    """Cap this process's address space at its current size + ``margin`` for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + margin
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="the memory cap reads /proc")


def _fuzz(
    record_property: Callable[[str, object], None], name: str, test: Callable[[], None], count: list[int]
) -> None:
    """Run a hypothesis test under the memory cap and report how many inputs it generated."""
    with memory_cap():
        test()
    record_property("inputs", count[0])
    print(f"\nfuzz {name}: {count[0]} inputs")
    assert count[0] > 0


def _only_our_errors(call: Callable[[], object]) -> object:
    """``call()``'s result, or None when it raised one of the harness's own errors."""
    try:
        return call()
    except HarnessError:
        return None


# --- values from outside ---------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**40, 2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1.5, 3.0, 1e308]),
    st.text(max_size=8),
    st.sampled_from(["012", "decoder", "moe_ordinal", "5", "abc", ""]),
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


DEEP = "@@DEEP@@"
"""A placeholder value, replaced in the JSON text by ``DEPTHS`` nested lists."""
DEPTHS = st.sampled_from([10, 40, 200, 990, 5000])
"""Nesting of every depth class: shallow, past the baseline bound, near and past Python's recursion limit."""


def _nest(text: str, depth: int) -> str:
    """``text`` with the first quoted ``DEEP`` placeholder (also inside an embedded JSON string) nested."""
    deep = "[" * depth + "]" * depth
    for quoted in (f'"{DEEP}"', f'\\"{DEEP}\\"'):
        if quoted in text:
            return text.replace(quoted, deep, 1)
    return text


# --- trace files and the constructor ------------------------------------------------------------

GOOD = RoutingTrace(
    np.array([[[0, 1], [2, 3], [1, 3]]] * 2, np.uint8),
    num_experts=4,
    moe_layers=[0, 1, 2],
    provenance=Provenance("vllm", "0.22.0", "vllm-0.22"),
)
METADATA_FIELDS = ("num_experts", "num_layers", "moe_layers", "layer_axis", "start", "provenance")


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _join(header: Any, data: bytes, depth: int = 0) -> bytes:
    text = _nest(json.dumps(header, allow_nan=True), depth).encode()
    return len(text).to_bytes(8, "little") + text + data


def _with_crc(meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata with a matching ``metadata_crc32``, so that the checks behind the CRC are reached."""
    from harness.trace.storage import metadata_crc32

    try:
        meta["metadata_crc32"] = metadata_crc32({k: meta.get(k) for k in METADATA_FIELDS})
    except (ValueError, RecursionError):  # a value json cannot write: the CRC stays as it was
        pass
    return meta


@st.composite
def trace_files(draw: st.DrawFn) -> bytes:
    """A valid trace file with one part replaced: a metadata field, the tensor entry, the header or bytes."""
    header, data = _split(GOOD.to_bytes())
    meta = json.loads(header["__metadata__"]["routing_trace"])
    where = draw(st.sampled_from(["metadata", "tensor", "header", "bytes"]))
    if where == "metadata":
        meta[draw(st.sampled_from(METADATA_FIELDS))] = draw(JSON_VALUES | st.just(DEEP))
        if draw(st.booleans()):  # a declared size bomb next to an honest array
            meta.update(num_layers=draw(st.sampled_from([2**31, 2**40, 65537])), moe_layers=None)
        header["__metadata__"]["routing_trace"] = json.dumps(_with_crc(meta), allow_nan=True)
    elif where == "tensor":
        info = header["experts"]
        key = draw(st.sampled_from(["shape", "dtype", "data_offsets"]))
        info[key] = draw(
            st.lists(st.sampled_from([0, 1, 2, 3, 2**31, 2**40, 2**62, -1]), max_size=4) | JSON_VALUES
        )
        if key == "shape" and draw(st.booleans()):
            data = b""
            info["data_offsets"] = [0, 0]
    elif where == "header":
        header[draw(st.sampled_from(["__metadata__", "experts", "extra"]))] = draw(
            JSON_VALUES | st.just(DEEP)
        )
    else:
        raw = bytearray(_join(header, data))
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw[: draw(st.integers(0, len(raw)))])
    return _join(header, data, draw(DEPTHS))


def test_trace_files_raise_only_trace_errors(record_property: Any, tmp_path: Path) -> None:
    """Bytes and files (read by two entry points of the safetensors library) alike."""
    count = [0]
    path = tmp_path / "fuzzed.safetensors"

    @FUZZ
    @given(trace_files())
    def run(raw: bytes) -> None:
        count[0] += 1
        trace = _only_our_errors(lambda: RoutingTrace.from_bytes(raw))
        path.write_bytes(raw)
        from_file = _only_our_errors(lambda: RoutingTrace.load(path))
        assert from_file == trace, "the file and its bytes read differently"
        if trace is not None:  # what is accepted is a trace that round-trips
            assert isinstance(trace, RoutingTrace) and RoutingTrace.from_bytes(trace.to_bytes()) == trace
            repr(trace)

    _fuzz(record_property, "trace files", run, count)


EXPERTS = st.sampled_from(
    [
        np.zeros((1, 3, 1), np.int32),
        np.array([[[0, 1], [2, 3], [1, 3]]], np.int64),
        np.zeros((0, 3, 2), np.uint8),
        np.zeros((2, 0, 1), np.int16),
        torch.zeros((1, 3, 1), dtype=torch.bfloat16),
        torch.tensor([[[0, 1], [2, 3], [1, 3]]]),
        np.zeros((1, 3, 1), bool),
        np.zeros((1, 3, 1), np.float32),
        [[[0], [1], [2]]],
        [[[0], [1, 2]]],
        "experts",
    ]
)


def test_routing_trace_constructor_raises_only_trace_errors(record_property: Any) -> None:
    count = [0]

    @FUZZ
    @given(
        experts=EXPERTS,
        num_experts=st.sampled_from([4, 8]) | _SCALARS,
        num_layers=st.none() | st.sampled_from([3, 2**31, 2**40]) | _SCALARS,
        moe_layers=st.none()
        | st.sampled_from([[], [0, 1, 2], [1, 2], (0,), range(3), range(2**40), "012", 3])
        | st.lists(_SCALARS, max_size=4),
        layer_axis=st.sampled_from(["decoder", "moe_ordinal"]) | _SCALARS,
        start=st.sampled_from([0, 1]) | _SCALARS,
        provenance=st.none() | st.just(Provenance()) | JSON_VALUES,
    )
    def run(**kwargs: Any) -> None:
        count[0] += 1
        trace = _only_our_errors(lambda: RoutingTrace(**kwargs))
        if trace is not None:
            assert RoutingTrace.from_bytes(trace.to_bytes()) == trace
            repr(trace)

    _fuzz(record_property, "RoutingTrace(...)", run, count)


# --- gate baselines ----------------------------------------------------------------------------

BASELINE = json.loads((ROOT / "fixtures" / "baselines" / "reference.json").read_text())
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 320, "9" * 4301, "true", "1.0"]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value of ``doc`` (objects and lists walked)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    out = [prefix] if prefix else []
    for key, child in items:
        out += _paths(child, (*prefix, key))
    return out


PATHS = _paths(BASELINE)


@st.composite
def baseline_files(draw: st.DrawFn) -> bytes:
    """The committed reference baseline with one value replaced by a generated value or raw JSON text."""
    doc = json.loads(json.dumps(BASELINE))
    path = draw(st.sampled_from(PATHS))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    kind = draw(st.sampled_from(["value", "raw", "deep", "bytes"]))
    if kind == "bytes":
        text = json.dumps(doc).encode()
        cut = draw(st.integers(0, len(text)))
        return text[:cut] + draw(st.binary(min_size=1, max_size=4)) + text[cut:]
    if kind == "value":
        parent[path[-1]] = draw(JSON_VALUES)
        return json.dumps(doc, allow_nan=True).encode()
    parent[path[-1]] = "@@"
    if kind == "deep":
        return _nest(json.dumps(doc).replace('"@@"', f'"{DEEP}"', 1), draw(DEPTHS)).encode()
    return json.dumps(doc).replace('"@@"', draw(st.sampled_from(RAW_NUMBERS)), 1).encode()


def test_baselines_raise_only_baseline_errors_and_never_pass_non_finite(
    record_property: Any, tmp_path: Path
) -> None:
    count = [0]
    file = tmp_path / "baseline.json"

    @FUZZ
    @given(baseline_files())
    def run(raw: bytes) -> None:
        count[0] += 1
        file.write_bytes(raw)
        doc = _only_our_errors(lambda: bl.load_baseline(file))
        if doc is None:
            return
        for name, entry in doc["metrics"].items():  # what loads is finite and bounded: the gate stays on
            for key in ("value", "tolerance"):
                number = entry[key]
                assert number is None or (not isinstance(number, bool) and math.isfinite(number)), entry
            assert entry["tolerance"] is None or entry["tolerance"] <= bl.max_tolerance(name), entry
        for old, new in ((BASELINE, doc), (doc, BASELINE), (doc, doc)):
            _only_our_errors(lambda old=old, new=new: gate_compare(old, new).format())  # type: ignore[misc]

    _fuzz(record_property, "gate baselines", run, count)


@pytest.mark.parametrize("kind", ["directory", "not a directory", "missing"])
def test_a_baseline_path_that_is_not_a_readable_file_is_a_baseline_error(tmp_path: Path, kind: str) -> None:
    (tmp_path / "file").write_text("{}")
    path = {"directory": tmp_path, "not a directory": tmp_path / "file" / "x.json"}.get(
        kind, tmp_path / "none.json"
    )
    with pytest.raises(bl.BaselineError, match=str(path)):
        bl.load_baseline(path)


# --- HTTP responses ------------------------------------------------------------------------------

SPEC = ModelSpec(num_layers=3, num_experts=8, top_k=2, moe_layers=(1, 2))
_ROUTES = np.tile(np.array([[0, 0], [1, 2], [3, 4]], np.int32), (6, 1, 1))
COUNTS = st.sampled_from([4, 3, 0, 2**40]) | _SCALARS
"""Token counts: right, wrong, and not integers (``null``, ``"5"``, ``True``, ``1.9``, NaN, …)."""


@st.composite
def http_responses(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["sglang_generate", "sglang_openai", "vllm"]))
    payload = encode_sglang_b64(_ROUTES)
    if kind == "sglang_generate":
        counts = {"prompt_tokens": draw(COUNTS), "completion_tokens": draw(COUNTS)}
        return kind, {"meta_info": {**counts, "routed_experts": payload}}
    if kind == "sglang_openai":
        counts = {"prompt_tokens": draw(COUNTS), "completion_tokens": draw(COUNTS)}
        return kind, {"usage": counts, "sglext": {"routed_experts": payload}}
    buffer = __import__("io").BytesIO()
    np.save(buffer, _ROUTES.astype(np.uint8))
    choice: dict[str, Any] = {"routed_experts": base64.b64encode(buffer.getvalue()).decode()}
    if draw(st.booleans()):
        choice["token_ids"] = draw(
            st.lists(st.integers(0, 9), max_size=5) | st.lists(_SCALARS, min_size=3, max_size=3) | _SCALARS
        )
    usage = {"completion_tokens": draw(COUNTS)}
    if draw(st.booleans()):
        usage["prompt_tokens"] = draw(COUNTS)
    return kind, {"choices": [choice], "usage": usage}


def test_http_decoders_raise_only_convention_errors_and_never_coerce(record_property: Any) -> None:
    count = [0]
    decode = {
        "sglang_generate": lambda r: http.sglang_generate_trace(r, model=SPEC),
        "sglang_openai": lambda r: http.sglang_openai_trace(r, model=SPEC),
        "vllm": lambda r: http.vllm_completion_trace(r, model=SPEC, prompt_len=4),
    }

    @FUZZ
    @given(http_responses())
    def run(case: tuple[str, dict[str, Any]]) -> None:
        count[0] += 1
        kind, response = case
        trace = _only_our_errors(lambda: decode[kind](response))
        if trace is None:
            return
        counts = response.get("meta_info") or response.get("usage") or {}
        for key, value in counts.items():  # accepted counts were JSON integers, not "5", True or 1.9
            assert not key.endswith("_tokens") or type(value) is int, counts
        if kind == "vllm":  # and they agreed with each other: token_ids, usage and the prompt length
            token_ids = response["choices"][0].get("token_ids")
            if token_ids is not None:
                assert all(type(t) is int and t >= 0 for t in token_ids), token_ids
                assert counts.get("completion_tokens", len(token_ids)) == len(token_ids), response
            assert counts.get("prompt_tokens", 4) == 4, response
        else:
            assert counts["prompt_tokens"] >= 1, counts

    _fuzz(record_property, "HTTP responses", run, count)


# --- subject specs -------------------------------------------------------------------------------

MODULE_BODIES = {
    "exits": "import sys\nsys.exit(0)\n",
    "exits_1": "raise SystemExit(1)\n",
    "syntax": "def f(:\n",
    "raises": "raise RuntimeError('boom')\n",
    "imports_missing": "import no_such_module_rrh\n",
    "not_a_subject": "SUBJECT = 3\n",
    # a module-level __getattr__ (a lazy import) that fails with something other than AttributeError
    "lazy_runtime": "def __getattr__(name):\n    raise RuntimeError('lazy init failed')\n",
    "lazy_import": "def __getattr__(name):\n    raise ImportError('no module named torch_lazy')\n",
    "good": "from harness.subjects import Subject\nSUBJECT = Subject(name='good')\n",
}


def test_subject_specs_raise_only_subject_errors(
    record_property: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, body in MODULE_BODIES.items():
        (tmp_path / f"rrh_fuzz_{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    count = [0]
    names = st.sampled_from([f"rrh_fuzz_{n}" for n in MODULE_BODIES]) | st.text("ab._1", max_size=6)
    specs = st.builds(
        lambda m, sep, a: f"{m}{sep}{a}",
        names,
        st.sampled_from([":", "", "::"]),
        st.text("S_UBJECT.", max_size=8),
    )

    @FUZZ
    @given(specs | st.sampled_from([".x:S", "..:S", ":S", "x:", "", "rrh_fuzz_good:SUBJECT"]))
    def run(spec: str) -> None:
        count[0] += 1
        for module in [m for m in sys.modules if m.startswith("rrh_fuzz_")]:
            del sys.modules[module]
        subject = _only_our_errors(lambda: load_subject(spec))
        assert subject is None or (isinstance(subject, Subject) and spec == "rrh_fuzz_good:SUBJECT")

    _fuzz(record_property, "subject specs", run, count)


# --- inputs the fuzz of issue 32 found accepted: each refused, naming the field ---------------------

_PAYLOAD = encode_sglang_b64(_ROUTES)


def _vllm(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> Any:
    buffer = __import__("io").BytesIO()
    np.save(buffer, _ROUTES.astype(np.uint8))
    body = {"choices": [{"routed_experts": base64.b64encode(buffer.getvalue()).decode(), **choice}]}
    return lambda: http.vllm_completion_trace({**body, "usage": usage or {}}, model=SPEC, prompt_len=4)


@pytest.mark.parametrize(
    ("decode", "field"),
    [
        (_vllm({"token_ids": ["a", None, 3]}), "choices[0].token_ids[0]"),
        (_vllm({"token_ids": [1.5, 2, 3]}), "choices[0].token_ids[0]"),
        (_vllm({"token_ids": [1, 2, 3]}, {"completion_tokens": 4}), "usage.completion_tokens"),
        (_vllm({"token_ids": [1, 2, 3]}, {"prompt_tokens": 5}), "usage.prompt_tokens"),
        (_vllm({"token_ids": [1, 2, 3], "prompt_token_ids": [1, 2]}), "choices[0].prompt_token_ids"),
        (
            lambda: http.sglang_generate_trace(
                {"meta_info": {"prompt_tokens": 0, "completion_tokens": 7, "routed_experts": _PAYLOAD}},
                model=SPEC,
            ),
            "meta_info.prompt_tokens",
        ),
        (
            lambda: http.sglang_openai_trace(
                {"choices": [{}, {}], "usage": {"prompt_tokens": 4, "completion_tokens": 3},
                 "sglext": {"routed_experts": _PAYLOAD}}, model=SPEC,
            ),
            "choices",
        ),
        (
            lambda: __import__("harness.conventions", fromlist=["x"]).decode_sglang_meta(
                _PAYLOAD, model=SPEC, prompt_len=0, response_len=7
            ),
            "prompt_len",
        ),
    ],
    ids=["token-ids-not-ints", "token-ids-floats", "usage-completion", "usage-prompt", "prompt-token-ids",
         "sglang-empty-prompt", "sglang-openai-two-choices", "sglang-payload-empty-prompt"],
)  # fmt: skip
def test_a_response_the_fuzz_once_accepted_is_refused_naming_the_field(decode: Any, field: str) -> None:
    with pytest.raises(HarnessError) as err:
        decode()
    assert field in str(err.value) and "\n" not in str(err.value), str(err.value)


def _with(edit: Callable[[dict[str, Any]], None]) -> str:
    doc = json.loads(json.dumps(BASELINE))
    edit(doc)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (json.dumps(BASELINE).replace('"engine": ', '"engine": "x", "engine": ', 1), "key 'engine'"),
        (_with(lambda d: d.update(metric={})), "'metric': an unknown field"),
        (_with(lambda d: next(iter(d["metrics"].values())).update(tolerence=0.1)), ".tolerence: an unknown"),
        (_with(lambda d: d.update(harness_version=5)), "harness_version: expected a string"),
        (_with(lambda d: d.update(version="\ud800")), "lone surrogate"),
    ],
    ids=["duplicate-key", "unknown-field", "unknown-metric-field", "harness-version", "surrogate"],
)  # fmt: skip
def test_a_baseline_the_fuzz_once_accepted_is_refused_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(bl.BaselineError) as err:
        bl.load_baseline(path)
    assert field in str(err.value) and str(path) in str(err.value), str(err.value)


def test_the_memory_cap_turns_a_bomb_into_a_memory_error() -> None:
    """The cap itself works: a 4 GiB allocation inside it fails at once, and after it the limit is back."""
    before = resource.getrlimit(resource.RLIMIT_AS)
    with memory_cap(), pytest.raises(MemoryError):
        np.ones(1 << 32, dtype=np.uint8)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
