"""``harness.audit.importers.safe_pickle``: untrusted pickles are read through an allowlist.

A pickle that names any other global is refused before anything in it runs (a planted
``os.system`` never writes its marker); framework classes become plain stand-ins; torch's tensor
format is decoded into numpy arrays bit for bit, with every strided view bounds-checked; and a
pickle that is not what an importer expects gives one line naming the file and the field.

``NamedGlobals`` writes pickles naming framework globals (``verl.protocol.DataProto`` …) without
the framework installed: the synthetic dumps of ``test_audit_import_frameworks`` use it too.
"""

from __future__ import annotations

import io
import os
import pickle
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.audit.importers import pickle_values, safe_pickle, skyrl
from harness.audit.layout.schema import LayoutError


class NamedGlobals(pickle._Pickler):
    """A pickler that writes a class or function carrying ``rrh_global = (module, name)`` as that
    global, without importing ``module``: how a framework's own pickle names its classes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and "rrh_global" in vars(obj):
            return obj.__name__  # pickled by name: through save_global below
        return NotImplemented

    def save_global(self, obj: Any, name: Any = None) -> None:
        if not (isinstance(obj, (type, types.FunctionType)) and "rrh_global" in vars(obj)):
            super().save_global(obj, name)
            return
        module, qualname = obj.rrh_global
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


PICKLE_MODULE = types.SimpleNamespace(
    __name__="pickle", Pickler=NamedGlobals, Unpickler=pickle.Unpickler, load=pickle.load
)
"""A ``pickle_module`` for ``torch.save`` that writes ``rrh_global`` names."""


def named(module: str, name: str, obj: Any) -> Any:
    """``obj`` (a class or function), to be pickled as the global ``module.name``."""
    obj.rrh_global = (module, name)
    return obj


def dumps_named(obj: Any) -> bytes:
    buffer = io.BytesIO()
    NamedGlobals(buffer, protocol=4).dump(obj)
    return buffer.getvalue()


def torch_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` (zip format), ``rrh_global`` names written as such."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=PICKLE_MODULE)
    return buffer.getvalue()


class _Reduce:
    """An object that pickles as ``func(*args)``."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


# --- nothing from the pickle runs ----------------------------------------------------------------


def test_a_pickle_calling_os_system_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = tmp_path / "dumped_data" / "global_step_1_training_input.pkl"
    evil.parent.mkdir()
    evil.write_bytes(pickle.dumps([1, _Reduce(os.system, f"touch {marker}")]))
    with pytest.raises(LayoutError) as err:
        safe_pickle.load(evil)
    message = str(err.value)
    assert str(evil) in message and ("posix.system" in message or "os.system" in message)
    assert "\n" not in message
    with pytest.raises(LayoutError, match=r"refused global (posix|os)\.system"):
        list(skyrl.records(tmp_path, num_experts=8))
    assert not marker.exists()


def test_a_global_inside_a_torch_archive_is_refused_too(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    data = torch_bytes({"x": torch.zeros(2), "y": _Reduce(os.system, f"touch {marker}")})
    with pytest.raises(LayoutError, match=r"batch\.pt: refused global (posix|os)\.system"):
        safe_pickle.load_torch_bytes(data, "batch.pt")
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        _Reduce(getattr, _Reduce(__import__, "os"), "system"),
        _Reduce(eval, "1"),
        _Reduce(__import__("subprocess").call, ["true"]),
    ],
    ids=["getattr", "eval", "subprocess"],
)
def test_common_escape_routes_are_refused(payload: Any) -> None:
    with pytest.raises(LayoutError, match=r"^dump\.pkl: refused global "):
        safe_pickle.SafeUnpickler(io.BytesIO(pickle.dumps(payload)), source="dump.pkl").load()


def test_codecs_encode_is_latin1_only() -> None:
    ok = pickle.dumps(b"\x00\xff", protocol=2)  # protocol 2 stores bytes as _codecs.encode(…, 'latin1')
    assert safe_pickle.SafeUnpickler(io.BytesIO(ok), source="p").load() == b"\x00\xff"
    hostile = _Reduce(__import__("codecs").encode, "x", "rot13")
    with pytest.raises(LayoutError, match="encoding 'rot13' refused"):
        safe_pickle.SafeUnpickler(io.BytesIO(pickle.dumps(hostile, protocol=2)), source="p").load()


@pytest.mark.parametrize(
    ("call", "said"),
    [(set, "a set (builtins.set) holds"), (frozenset, "a set (builtins.set) holds"),
     (OrderedDict, "an ordered dict (collections.OrderedDict) holds"), (set, "a set (builtins.set) made of"),
     (__import__("codecs").encode, "bytes (_codecs.encode) of"), (torch.device, "torch.device of"),
     (torch.Size, "torch.Size made of")],
    ids=["set", "frozenset", "ordered-dict", "set-of-it", "codecs-encode", "torch-device", "torch-size"],
)  # fmt: skip
def test_a_refused_builtin_names_the_file_and_no_internal_class(call: Any, said: str) -> None:
    """A set, an OrderedDict, bytes, a device or a size made of a numpy array whose BUILD never came
    said ``builtins.set: item PendingArray refused``: no file, and the reader's own class name."""
    from tests.fuzz_audit import _Call, _reconstruct, dumps

    unbuilt = _Call(_reconstruct(), np.ndarray, (0,), b"b")
    items = unbuilt if "made of" in said or call in (torch.device, __import__("codecs").encode) else [unbuilt]
    with pytest.raises(LayoutError) as err:
        safe_pickle.SafeUnpickler(io.BytesIO(dumps(_Call(call, items))), source="dump.pkl").load()
    text = str(err.value)
    assert text.startswith(f"dump.pkl: {said} a numpy array without its contents"), text
    assert "Pending" not in text and "\n" not in text, text


def test_framework_classes_become_stand_ins_and_their_code_never_runs(tmp_path: Path) -> None:
    ran: list[str] = []

    class DataProto:
        def __getstate__(self) -> Any:
            return (b"batch", {"uid": np.array(["a"], dtype=object)}, {"k": np.float64(1.5)})

        def __setstate__(self, state: Any) -> None:
            ran.append("setstate")

    named("verl.protocol", "DataProto", DataProto)
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(dumps_named(DataProto()))
    with pytest.raises(LayoutError, match=r"refused global verl\.protocol\.DataProto"):
        safe_pickle.load(path)
    key, cls = pickle_values.stand_in("verl.protocol", "DataProto")
    obj = safe_pickle.load(path, {key: cls})
    assert isinstance(obj, cls) and obj.qualname == "verl.protocol.DataProto"
    batch, non_tensor, meta = obj.state
    assert batch == b"batch" and non_tensor["uid"].tolist() == ["a"] and meta == {"k": 1.5}
    assert ran == []


# --- torch's tensor format, decoded without torch ------------------------------------------------


def test_torch_tensors_are_read_bit_for_bit() -> None:
    tensors = {
        "strided": torch.arange(24, dtype=torch.int16).reshape(4, 6)[:, 1::2].t(),
        "bf16": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16),
        "u16": torch.tensor([1, 65535], dtype=torch.uint16),
        "u8": torch.arange(5, dtype=torch.uint8),
        "f32": torch.randn(3, 2),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
    }
    read = safe_pickle.load_torch_bytes(torch_bytes({**tensors, "device": torch.device("cpu")}), "t.pt")
    for name, tensor in tensors.items():
        want = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        assert read[name].dtype == want.dtype and np.array_equal(read[name], want), name
    assert read["device"] == "cpu"


def test_a_tensor_reaching_past_its_storage_is_refused() -> None:
    storage = torch.zeros(4, dtype=torch.int16).untyped_storage()

    def tensor(offset: int, size: int, stride: int) -> bytes:
        rebuild = _Reduce(
            torch._utils._rebuild_tensor_v3,
            storage,
            offset,
            (size,),
            (stride,),
            False,
            OrderedDict(),
            torch.int16,
        )
        return torch_bytes({"x": rebuild})

    with pytest.raises(
        LayoutError, match=r"t\.pt: tensor size \(3,\) stride \(1,\) offset 2 reaches element 4"
    ):
        safe_pickle.load_torch_bytes(tensor(2, 3, 1), "t.pt")
    with pytest.raises(
        LayoutError, match=r"t\.pt: tensor size \(3,\) stride \(2,\) offset 0 reaches element 4"
    ):
        safe_pickle.load_torch_bytes(tensor(0, 3, 2), "t.pt")
    with pytest.raises(
        LayoutError, match=r"tensor size \(1000,\) declares more elements than the 4 of its storage"
    ):
        safe_pickle.load_torch_bytes(tensor(0, 1000, 0), "t.pt")
    assert safe_pickle.load_torch_bytes(tensor(1, 3, 1), "t.pt")["x"].tolist() == [0, 0, 0]


def test_a_shape_that_overflows_int64_is_refused_naming_it() -> None:
    """An empty tensor or array whose non-zero sizes multiply past 2**63 (``(2**32, 2**32, 0)``) was
    numpy's ``ValueError`` (a traceback): numpy refuses the shape even with no elements. Strides are
    not sizes: a 5-d tensor's strides multiply past 2**63 and it is still read."""
    storage = torch.zeros(4, dtype=torch.int16).untyped_storage()
    rebuild = _Reduce(torch._utils._rebuild_tensor_v3, storage, 0, (2**32, 2**32, 0), (0, 0, 1), False,
                      OrderedDict(), torch.int16)  # fmt: skip
    with pytest.raises(LayoutError, match=r"^t\.pt: tensor size: shape \[4294967296, 4294967296, 0\] of "
                                          r"2-byte elements overflows int64"):  # fmt: skip
        safe_pickle.load_torch_bytes(torch_bytes({"x": rebuild}), "t.pt")
    deep = torch.zeros(1, dtype=torch.int8).expand(1, 1, 1, 1, 1)
    wide = torch.as_strided(torch.zeros(1, dtype=torch.int8), (1, 1, 1, 1, 1), (10**5,) * 5)
    read = safe_pickle.load_torch_bytes(torch_bytes({"x": deep.contiguous(), "w": wide}), "t.pt")
    assert read["x"].shape == read["w"].shape == (1, 1, 1, 1, 1)


def test_a_numpy_array_shape_that_overflows_int64_is_refused_naming_it(tmp_path: Path) -> None:
    """A pickled numpy array of shape ``(2**32, 2**32, 0)`` and no bytes: numpy's ``ValueError``."""
    from tests.fuzz_audit import dumps, fake_array

    path = tmp_path / "a.pkl"
    path.write_bytes(dumps({"x": fake_array((2**32, 2**32, 0), np.dtype("i8"), b"")}))
    with pytest.raises(LayoutError, match=r"a\.pkl: numpy array: shape \[4294967296, 4294967296, 0\] of "
                                          r"8-byte elements overflows int64"):  # fmt: skip
        safe_pickle.load(path)


def test_a_compressed_storage_record_is_refused() -> None:
    """torch stores its records; a deflated one could expand without bound (a zip bomb)."""
    source = zipfile.ZipFile(io.BytesIO(torch_bytes({"x": torch.zeros(64)})))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        for name in source.namelist():
            deflated.writestr(name, source.read(name))
    with pytest.raises(
        LayoutError, match=r"^t\.pt: record \S+ is compressed \(method 8\); expected stored bytes"
    ):
        safe_pickle.load_torch_bytes(buffer.getvalue(), "t.pt")


def test_a_truncated_or_foreign_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cut.pkl"
    path.write_bytes(pickle.dumps({"a": list(range(100))})[:40])
    declared = rf"^{path}: the pickle declares \d+ bytes where \d+ are left"
    with pytest.raises(LayoutError, match=declared) as err:
        safe_pickle.load(path)
    assert "\n" not in str(err.value)
    with pytest.raises(LayoutError, match=r"^b: not a torch\.save archive"):
        safe_pickle.load_torch_bytes(b"not a zip", "b")
    with pytest.raises(LayoutError, match="cannot be opened"):
        safe_pickle.load(tmp_path / "absent.pkl")


# --- a pickle that is not the class it claims ----------------------------------------------------


def _skyrl_dump(tmp_path: Path, state: Any, top: Any = None) -> Path:
    """A file shaped like ``TrainingInputBatch.save`` (``_rebuild_tensor_batch(cls, state)``)."""

    class TrainingInputBatch:
        pass

    def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
        raise AssertionError("never called")

    named(skyrl.MODULE, "TrainingInputBatch", TrainingInputBatch)
    named(skyrl.MODULE, "_rebuild_tensor_batch", _rebuild_tensor_batch)
    path = tmp_path / "dumped_data" / "global_step_3_training_input.pkl"
    path.parent.mkdir(exist_ok=True)
    obj = _Reduce(_rebuild_tensor_batch, TrainingInputBatch, state) if top is None else top
    path.write_bytes(dumps_named(obj))
    return path


@pytest.mark.parametrize(
    ("state", "top", "expected"),
    [
        (None, [1, 2, 3], "the pickle holds list; expected a TrainingInputBatch"),
        ([1, 2], None, "field 'state' is list; expected the TrainingInputBatch state dict"),
        ({"batch_dict": [1]}, None, "field 'batch_dict' is list; expected a dict of tensors"),
        (
            {"batch_dict": {"sequences": [1, 2]}},
            None,
            "field 'sequences' is list; expected a serialized tensor",
        ),
        (
            {
                "batch_dict": {
                    "sequences": {"format": "numpy", "data": b"\0" * 3, "shape": (2,), "dtype": "int64"}
                }
            },
            None,
            "field 'sequences' holds 3 bytes; expected 16 for int64 (2,)",
        ),
    ],
    ids=["list-for-batch", "list-for-state", "list-for-fields", "list-for-tensor", "short-bytes"],
)
def test_a_pickle_that_is_not_what_it_claims_names_file_and_field(
    tmp_path: Path, state: Any, top: Any, expected: str
) -> None:
    path = _skyrl_dump(tmp_path, state, top)
    with pytest.raises(LayoutError) as err:
        list(skyrl.records(tmp_path, num_experts=8))
    message = str(err.value)
    assert message.startswith(str(path)) and expected in message and "\n" not in message


def test_a_framework_rebuild_function_refusing_its_argument_names_the_file() -> None:
    """SkyRL's ``_rebuild_tensor_batch`` stand-in given no class said ``skyrl….: expected a class
    argument``, naming no file: every other refusal of the unpickler names it."""
    from tests.fuzz_audit import _Call, dumps

    def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
        raise AssertionError("never called")

    named("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch", _rebuild_tensor_batch)
    key, rebuild = pickle_values.stand_in_function(
        "skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch"
    )
    data = dumps(_Call(_rebuild_tensor_batch, 3, {}))
    with pytest.raises(LayoutError) as err:
        safe_pickle.SafeUnpickler(io.BytesIO(data), source="step.pkl", stand_ins={key: rebuild}).load()
    assert str(err.value).startswith(
        "step.pkl: skyrl.backends.skyrl_train.training_batch._rebuild_tensor_batch: expected a class argument"
    ), err.value
