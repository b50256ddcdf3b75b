"""Reading untrusted pickles (framework dumps) through an explicit allowlist of globals.

Unpickling calls whatever the file names, so a dump is read by ``SafeUnpickler``, whose
``find_class`` hands out only:

- container builtins (``collections.OrderedDict``, ``builtins.set``, ``builtins.frozenset``) and
  ``_codecs.encode`` restricted to latin-1 (how protocol 2 stores bytes);
- numpy's array, dtype and scalar reconstructors (an object array holds only what this unpickler
  itself allowed);
- torch's tensor format, decoded here into numpy arrays without torch: ``torch._utils.
  _rebuild_tensor_v2``/``_v3``, the storage kinds (``torch.FloatStorage`` …,
  ``torch.storage.UntypedStorage``), ``torch.<dtype>``, ``torch.device`` and ``torch.Size``;
- tensordict's consolidated ``TensorDict`` (``tensordict._reductions.
  _rebuild_tensordict_files_consolidated``, what verl's ``DataProto`` pickles), decoded into a dict;
- the stand-ins an importer names for its framework's classes (``Pickled`` subclasses made by
  ``stand_in``), which keep the pickled arguments and state as plain containers.

So no framework code runs, none need be installed, and torch never unpickles anything. Any other
global is refused before anything is called, with a ``LayoutError`` naming the file and the global.
Tensors nested in a pickle as ``torch.save`` bytes (verl's ``DataProto`` batch, SkyRL's bfloat16
fallback) are read by ``load_torch_bytes`` with the same unpickler, storages taken from the zip
archive and bounds-checked before any strided view is made.
"""

from __future__ import annotations

import codecs
import importlib
import io
import os
import pickle
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from harness.audit.layout import LayoutError

StandIns = Mapping[tuple[str, str], Any]
"""``(module, name) → object`` that a pickle's global resolves to, beyond the built-in allowlist."""


class Pickled:
    """A framework object as the pickle described it: the class's dotted name, the arguments of its
    construction, the state it was given (``BUILD``) and any items set on it; never its own code."""

    qualname = "?"
    args: tuple[Any, ...]
    state: Any
    items: dict[Any, Any]

    def __new__(cls, *args: Any) -> Pickled:
        # ``__new__``, not ``__init__``: protocol 2+ (``NEWOBJ``) creates instances without ``__init__``.
        obj = super().__new__(cls)
        obj.args, obj.state, obj.items = args, None, {}
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def __repr__(self) -> str:
        return f"<pickled {self.qualname}>"


def stand_in(module: str, name: str) -> tuple[tuple[str, str], type[Pickled]]:
    """A ``StandIns`` entry mapping ``module.name`` to a fresh ``Pickled`` subclass of that name."""
    cls = type(name, (Pickled,), {"qualname": f"{module}.{name}"})
    return (module, name), cls


def stand_in_function(module: str, name: str) -> tuple[tuple[str, str], Callable[..., Pickled]]:
    """A ``StandIns`` entry for a framework rebuild function ``module.name(cls, state)``: the call
    returns an instance of ``cls`` (itself a stand-in) holding ``state``, as the function would."""

    def rebuild(*args: Any) -> Pickled:
        if not args or not (isinstance(args[0], type) and issubclass(args[0], Pickled)):
            raise LayoutError(f"{module}.{name}: expected a class argument, got {args[:1]!r}")
        obj = args[0]()
        obj.__setstate__(args[1] if len(args) > 1 else None)
        return obj

    return (module, name), rebuild


# --- torch's tensor format, decoded into numpy ---------------------------------------------------

_BFLOAT16 = "bfloat16"
_TORCH_DTYPES: dict[str, str] = {
    "float64": "f8", "double": "f8", "float32": "f4", "float": "f4", "float16": "f2", "half": "f2",
    "bfloat16": _BFLOAT16, "int64": "i8", "long": "i8", "int32": "i4", "int": "i4", "int16": "i2",
    "short": "i2", "int8": "i1", "uint8": "u1", "uint16": "u2", "uint32": "u4", "uint64": "u8", "bool": "?",
}  # fmt: skip
"""torch dtype names → numpy dtype codes (bfloat16 is widened to float32 when read)."""
_STORAGE_KINDS: dict[str, str] = {
    "DoubleStorage": "f8", "FloatStorage": "f4", "HalfStorage": "f2", "BFloat16Storage": _BFLOAT16,
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?",
}  # fmt: skip


class _TorchDtype(str):
    """``torch.<dtype>`` as a pickle names it: the numpy code of its elements (immutable, no
    attributes: a pickle's ``BUILD`` cannot change what it means)."""

    __slots__ = ()


class _StorageKind(str):
    """``torch.<Kind>Storage`` / ``torch.storage.UntypedStorage``: the numpy code of its bytes."""

    __slots__ = ()


class _Storage(NamedTuple):
    """One storage of a torch archive: its bytes, read once however many tensors share them."""

    data: bytes
    code: str


def _element(code: str, big_endian: bool) -> np.dtype[Any]:
    dtype = np.dtype("<u2" if code == _BFLOAT16 else code)
    return dtype.newbyteorder(">") if big_endian and dtype.itemsize > 1 else dtype


def _widen_bfloat16(array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return (array.astype(np.uint32) << 16).view(np.float32)


def _torch_device(*args: Any) -> str:
    """``torch.device(...)`` as a plain string: where the tensor lived when it was saved."""
    return ":".join(str(a) for a in args)


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes: latin-1 only, never a codec by name."""
    if encoding not in ("latin1", "latin-1"):
        raise LayoutError(f"_codecs.encode: encoding {encoding!r} refused; expected 'latin1'")
    return codecs.encode(text, "latin1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    core = importlib.import_module("numpy._core.multiarray")  # numpy 1.x pickles name numpy.core
    allowed: dict[tuple[str, str], Any] = {("numpy", "dtype"): np.dtype, ("numpy", "ndarray"): np.ndarray}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = core._reconstruct
        allowed[(module, "scalar")] = core.scalar
    return allowed


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only allowlisted globals (see the module docstring).

    ``source`` names the file in every error. ``archive`` (a torch zip archive and its record
    prefix) serves ``torch.save``'s persistent storage ids; without one they are refused.
    """

    def __init__(
        self,
        file: Any,
        *,
        source: str,
        stand_ins: StandIns | None = None,
        archive: tuple[zipfile.ZipFile, str] | None = None,
        big_endian: bool = False,
    ) -> None:
        super().__init__(file)
        self.source = source
        self.archive = archive
        self.big_endian = big_endian
        self._storages: dict[str, _Storage] = {}
        self.allowed: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): OrderedDict,
            ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset,
            ("_codecs", "encode"): _latin1,
            ("torch", "device"): _torch_device,
            ("torch", "Size"): tuple,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_v3,
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): self._tensordict,
            ("torch.storage", "UntypedStorage"): _StorageKind("u1"),
            ("torch", "UntypedStorage"): _StorageKind("u1"),
            **{("torch", name): _StorageKind(code) for name, code in _STORAGE_KINDS.items()},
            **{("torch", name): _TorchDtype(code) for name, code in _TORCH_DTYPES.items()},
            **_numpy_globals(),
            **(stand_ins or {}),
        }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise LayoutError(
                f"{self.source}: refused global {module}.{name}: not in the allowlist of this importer "
                "(untrusted pickle; nothing in it was run)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self.archive is None:
            raise LayoutError(f"{self.source}: persistent id {pid!r} refused; expected a plain pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise LayoutError(
                f"{self.source}: persistent id {pid!r}; expected ('storage', kind, key, device, n)"
            )
        _, kind, key, _device, _numel = pid
        if not isinstance(kind, _StorageKind) or not isinstance(key, str):
            raise LayoutError(f"{self.source}: storage {pid!r}; expected a torch storage kind and a key")
        if key not in self._storages:
            archive, prefix = self.archive
            try:
                record = archive.getinfo(f"{prefix}data/{key}")
            except KeyError:
                raise LayoutError(
                    f"{self.source}: storage record data/{key} missing from the archive"
                ) from None
            if (
                record.compress_type != zipfile.ZIP_STORED
            ):  # torch stores; a compressed record could be a bomb
                raise LayoutError(
                    f"{self.source}: storage record data/{key} is compressed; expected stored bytes"
                )
            data = archive.read(record)
            self._storages[key] = _Storage(data, str(kind))
        return self._storages[key]

    def _rebuild(
        self, storage: Any, offset: Any, size: Any, stride: Any, code: str | None
    ) -> npt.NDArray[Any]:
        """The tensor ``storage[offset:]`` viewed with ``size``/``stride``, copied, every index checked."""
        if not isinstance(storage, _Storage):
            raise LayoutError(f"{self.source}: tensor without a storage record; expected a torch archive")
        code = storage.code if code is None else code
        element = _element(code, self.big_endian)
        if len(storage.data) % element.itemsize:
            raise LayoutError(
                f"{self.source}: storage of {len(storage.data)} bytes; expected whole {element} elements"
            )
        flat = np.frombuffer(storage.data, dtype=element)
        shape, strides = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        if len(shape) != len(strides) or any(s < 0 for s in shape + strides) or int(offset) < 0:
            raise LayoutError(
                f"{self.source}: tensor size {shape} / stride {strides}; expected matching, >= 0"
            )
        if int(np.prod(shape, dtype=np.float64)) > flat.size:
            raise LayoutError(
                f"{self.source}: tensor size {shape} declares more elements than the {flat.size} of its "
                "storage; expected a tensor within its storage"
            )
        if 0 in shape:
            array = np.empty(shape, dtype=element)
        else:
            last = int(offset) + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
            if last >= flat.size:
                raise LayoutError(
                    f"{self.source}: tensor size {shape} stride {strides} offset {int(offset)} "
                    f"reaches element {last}; expected < {flat.size}, the elements of its storage"
                )
            view = np.lib.stride_tricks.as_strided(
                flat[int(offset) :],
                shape=shape,
                strides=[s * element.itemsize for s in strides],
                writeable=False,
            )
            array = np.array(view)
        array = array.astype(array.dtype.newbyteorder("="), copy=False)
        return _widen_bfloat16(array) if code == _BFLOAT16 else array

    def _rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> npt.NDArray[Any]:
        return self._rebuild(storage, offset, size, stride, None)

    def _rebuild_v3(
        self, storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_: Any
    ) -> npt.NDArray[Any]:
        if not isinstance(dtype, _TorchDtype):
            raise LayoutError(f"{self.source}: tensor dtype {dtype!r}; expected a torch dtype")
        return self._rebuild(storage, offset, size, stride, str(dtype))

    def _tensordict(self, metadata: Any, storage: Any, prefix: str = "") -> dict[str, Any]:
        """A consolidated ``TensorDict`` (tensordict >= 0.5: one byte storage and per-leaf
        ``(dtype, shape, start, stop, pad)``) as a plain dict: arrays, nested dicts, non-tensor data."""
        meta = expect(metadata, dict, self.source, f"{prefix}tensordict metadata", "a dict")
        if not (isinstance(storage, np.ndarray) and storage.dtype == np.uint8 and storage.ndim == 1):
            raise LayoutError(
                f"{self.source}: tensordict storage is {type(storage).__name__}; expected flat bytes"
            )
        out: dict[str, Any] = {}
        for key, entry in expect(
            meta.get("non_tensors", {}), dict, self.source, f"{prefix}non_tensors", "a dict"
        ).items():
            out[key] = entry[0] if isinstance(entry, tuple) and entry else entry
        leaves = expect(meta.get("leaves", {}), dict, self.source, f"{prefix}leaves", "a dict of leaves")
        for key, leaf in leaves.items():
            field = f"{prefix}{key}"
            if not (
                isinstance(leaf, tuple) and len(leaf) == 5 and all(isinstance(x, int) for x in leaf[2:4])
            ):
                raise LayoutError(
                    f"{self.source}: field {field!r} is {leaf!r}; expected (dtype, shape, start, stop, pad)"
                )
            dtype, shape, start, stop, _pad = leaf
            if not 0 <= start <= stop <= len(storage):
                raise LayoutError(
                    f"{self.source}: field {field!r} spans bytes [{start}, {stop}); "
                    f"expected a span within the {len(storage)} bytes of the storage"
                )
            shape = tuple(shape) if isinstance(shape, (list, tuple)) else shape
            out[key] = view_bytes(storage[start:stop], dtype, shape, self.source, field)
        for key, sub in meta.items():
            if key not in ("non_tensors", "leaves", "cls", "cls_metadata", "size"):
                out[key] = self._tensordict(sub, storage, f"{prefix}{key}.")
        return out


def expect(value: Any, kind: type | tuple[type, ...], source: str, field: str, what: str) -> Any:
    """``value`` when it is a ``kind``, else a one-line ``LayoutError`` naming file, field and expectation.

    What a pickle holds is whatever it claims; each field an importer reads is checked through here.
    """
    if not isinstance(value, kind):
        raise LayoutError(f"{source}: field {field!r} is {type(value).__name__}; expected {what}")
    return value


def view_bytes(buffer: Any, dtype: Any, shape: Any, source: str, field: str) -> npt.NDArray[Any]:
    """The ``dtype`` (a torch dtype name, ``"torch.int16"`` or ``"int16"``) array of ``shape`` held
    in the bytes ``buffer`` (bytes or a uint8 array), as frameworks serialize tensors by hand."""
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise LayoutError(f"{source}: field {field!r} has dtype {dtype!r}; expected a numeric torch dtype")
    if not (isinstance(shape, (tuple, list)) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise LayoutError(f"{source}: field {field!r} has shape {shape!r}; expected a tuple of sizes")
    raw = np.frombuffer(buffer, dtype=np.uint8) if isinstance(buffer, bytes) else np.asarray(buffer)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise LayoutError(f"{source}: field {field!r} holds {raw.dtype} {raw.shape}; expected flat bytes")
    code = _TORCH_DTYPES[name]
    element = _element(code, big_endian=False)
    count = int(np.prod(shape))
    if raw.size < count * element.itemsize:
        raise LayoutError(
            f"{source}: field {field!r} holds {raw.size} bytes; "
            f"expected {count * element.itemsize} for {name} {list(shape)}"
        )
    array = np.frombuffer(raw[: count * element.itemsize].tobytes(), dtype=element).reshape(shape)
    return _widen_bfloat16(array) if code == _BFLOAT16 else array


def _unpickle(unpickler: SafeUnpickler) -> Any:
    try:
        return unpickler.load()
    except LayoutError:
        raise
    except Exception as err:  # any malformed input: one line naming the file
        raise LayoutError(
            f"{unpickler.source}: not a readable pickle ({type(err).__name__}: {err})"
        ) from None


def load(path: str | os.PathLike[str], stand_ins: StandIns | None = None) -> Any:
    """The object pickled in ``path``, read with ``SafeUnpickler`` and the importer's ``stand_ins``."""
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise LayoutError(f"{path}: cannot be opened ({err.strerror})") from None
    with handle:
        return _unpickle(SafeUnpickler(handle, source=str(path), stand_ins=stand_ins))


def load_torch_bytes(data: bytes, source: str, stand_ins: StandIns | None = None) -> Any:
    """The object in ``data``, bytes written by ``torch.save`` (zip format), tensors as numpy arrays."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise LayoutError(
            f"{source}: not a torch.save archive (zip format); expected torch >= 1.6 output"
        ) from None
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise LayoutError(f"{source}: {len(pickles)} data.pkl records in the archive; expected one")
    prefix = pickles[0][: -len("data.pkl")]
    names = set(archive.namelist())
    order = archive.read(f"{prefix}byteorder").decode().strip() if f"{prefix}byteorder" in names else "little"
    if order not in ("little", "big"):
        raise LayoutError(f"{source}: byteorder {order!r}; expected 'little' or 'big'")
    with archive.open(pickles[0]) as handle:
        unpickler = SafeUnpickler(
            handle, source=source, stand_ins=stand_ins, archive=(archive, prefix), big_endian=order == "big"
        )
        return _unpickle(unpickler)
