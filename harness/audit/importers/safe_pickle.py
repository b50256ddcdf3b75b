"""Reading untrusted pickles (framework dumps) through an explicit allowlist of globals.

Unpickling calls whatever the file names, so a dump is read by ``SafeUnpickler``, whose
``find_class`` hands out only:

- container builtins (``collections.OrderedDict``, ``builtins.set``, ``builtins.frozenset``) and
  ``_codecs.encode`` restricted to latin-1 (how protocol 2 stores bytes);
- numpy's array, dtype and scalar reconstructors, replaced by checking stand-ins: an array is
  rebuilt only from a numeric or fixed-width string dtype and exactly the bytes its shape needs
  (``np.frombuffer``: nothing is allocated from a declared size); an **object** array is never
  rebuilt (numpy would read past a short item list): it becomes an ``ObjectArray``, its items
  checked against its shape; ``numpy.ndarray`` itself is not callable;
- torch's tensor format, decoded here into numpy arrays without torch: ``torch._utils.
  _rebuild_tensor_v2``/``_v3``, the storage kinds (``torch.FloatStorage`` …,
  ``torch.storage.UntypedStorage``), ``torch.<dtype>``, ``torch.device`` and ``torch.Size``;
- tensordict's consolidated ``TensorDict`` (``tensordict._reductions.
  _rebuild_tensordict_files_consolidated``, what verl's ``DataProto`` pickles), decoded into a dict;
- the stand-ins an importer names for its framework's classes (``Pickled`` subclasses made by
  ``stand_in``), which keep the pickled arguments and state as plain containers.

So no framework code runs, none need be installed, and torch never unpickles anything. Any other
global is refused before anything is called, with a ``LayoutError`` naming the file and the global.
The unpickler is Python's own (``pickle._Unpickler``) reading through ``_Bounded``: every length
the pickle declares (bytes, strings, frames, byte arrays) is checked against the bytes left in the
file before anything is allocated, ``BUILD`` applies only to the stand-ins above, and a long load
can be interrupted by the file's time budget (``harness.audit.inputs.time_budget``).

Tensors in a ``torch.save`` archive (slime's ``.pt`` files, verl's ``DataProto`` batch, SkyRL's
bfloat16 fallback) are read by ``load_torch``/``load_torch_bytes`` with the same unpickler: records
must be stored (torch never compresses), unencrypted, inside the file and CRC-correct, and each
storage is bounds-checked before any strided view is made.
"""

from __future__ import annotations

import codecs
import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from harness.audit.inputs import brief, file_size, open_regular
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
            got = brief(args[0]) if args else "nothing"
            raise LayoutError(f"{module}.{name}: expected a class argument, got {got}")
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
    if not (1 <= len(args) <= 2 and all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args)):
        raise LayoutError(f"torch.device: arguments {brief(args)}; expected a device type and an index")
    return ":".join(str(a)[:64] for a in args)


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes: latin-1 only, never a codec by name."""
    if encoding not in ("latin1", "latin-1"):
        raise LayoutError(f"_codecs.encode: encoding {brief(encoding)} refused; expected 'latin1'")
    if not isinstance(text, str):
        raise LayoutError(f"_codecs.encode: {brief(text)}; expected a string")
    return codecs.encode(text, "latin1")


# --- numpy, rebuilt from checked bytes --------------------------------------------------------------

_ARRAY_KINDS = "biufcUS"
"""dtype kinds an array may be rebuilt with (booleans, integers, floats, complex, fixed-width strings);
objects become an ``ObjectArray``, and structured, void and datetime dtypes are refused."""
MAX_DIMS = 32


class ObjectArray:
    """An object array of a pickle (verl's ``non_tensor_batch``), never rebuilt as one: its items
    (whatever the unpickler itself allowed) in C order, and its shape."""

    __slots__ = ("items", "shape")

    def __init__(self, items: list[Any], shape: tuple[int, ...]) -> None:
        self.items, self.shape = items, shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 1

    def tolist(self) -> list[Any]:
        """The items nested as the shape says (``numpy.ndarray.tolist``)."""
        if not self.shape:
            return self.items[0] if self.items else []
        nested: list[Any] = list(self.items)
        for size in reversed(self.shape[1:]):
            nested = [nested[i : i + size] for i in range(0, len(nested), size)] if size else []
        return nested

    def __repr__(self) -> str:
        return f"<object array {list(self.shape)[:8]}>"


class _NdarrayClass:
    """``numpy.ndarray`` as a pickle names it: only an argument of ``_reconstruct``, never called."""

    def __repr__(self) -> str:
        return "numpy.ndarray"


_NDARRAY = _NdarrayClass()


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not (
        isinstance(value, tuple)
        and len(value) <= MAX_DIMS
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in value)
    ):
        raise LayoutError(f"{where}: shape {brief(value)}; expected a tuple of at most {MAX_DIMS} sizes >= 0")
    return value


class _PendingDtype:
    """``numpy.dtype(code, align, copy)`` before its ``BUILD`` state: the code, checked."""

    __slots__ = ("dtype", "source")

    def __init__(self, source: str, code: Any, *_: Any) -> None:
        self.source = source
        if not isinstance(code, str) or len(code) > 16:
            raise LayoutError(f"{source}: numpy dtype {brief(code)}; expected a type code such as 'i8'")
        try:
            dtype = np.dtype(code)
        except Exception:
            raise LayoutError(
                f"{source}: numpy dtype {brief(code)}; expected a type code such as 'i8'"
            ) from None
        if dtype.kind not in _ARRAY_KINDS + "O" or dtype.fields is not None or dtype.subdtype is not None:
            raise LayoutError(
                f"{source}: numpy dtype {brief(code)}; expected numbers, fixed-width strings or objects"
            )
        self.dtype = dtype

    def build(self, state: Any) -> np.dtype[Any]:
        """The dtype with ``state`` ``(version, byteorder, subarray, names, fields, elsize, alignment,
        flags)`` applied: a byte order, nothing structured."""
        if not (isinstance(state, tuple) and len(state) in (8, 9) and state[2:5] == (None, None, None)):
            raise LayoutError(
                f"{self.source}: numpy dtype state {brief(state)}; expected a plain dtype's "
                "(version, byteorder, None, None, None, elsize, alignment, flags)"
            )
        order, elsize = state[1], state[5]
        if order not in ("<", ">", "|", "="):
            raise LayoutError(f"{self.source}: numpy dtype byte order {brief(order)}; expected <, >, | or =")
        if not (isinstance(elsize, int) and elsize in (-1, self.dtype.itemsize)):
            raise LayoutError(
                f"{self.source}: numpy dtype {self.dtype} element size {brief(elsize)}; "
                f"expected {self.dtype.itemsize}"
            )
        return self.dtype.newbyteorder(order) if order in "<>" else self.dtype


def _resolve_dtype(value: Any, where: str) -> np.dtype[Any]:
    if isinstance(value, _PendingDtype):  # a dtype pickled without state
        return value.dtype
    if isinstance(value, np.dtype):
        return value
    raise LayoutError(f"{where}: array dtype is {brief(value)}; expected a numpy dtype")


class _PendingArray:
    """What ``_reconstruct(ndarray, (0,), b'b')`` returns: an array waiting for its ``BUILD`` state."""

    __slots__ = ("source",)

    def __init__(self, source: str) -> None:
        self.source = source

    def build(self, state: Any) -> npt.NDArray[Any] | ObjectArray:
        """The array of ``state`` ``([version,] shape, dtype, is_fortran, data)``, rebuilt only from
        ``data`` holding exactly what the shape needs."""
        where = f"{self.source}: numpy array"
        if not (isinstance(state, tuple) and len(state) in (4, 5)):
            raise LayoutError(
                f"{where} state {brief(state)}; expected (version, shape, dtype, fortran, data)"
            )
        shape, dtype, fortran, data = state[-4:]
        shape = _shape(shape, where)
        dtype = _resolve_dtype(dtype, where)
        count = math.prod(shape)
        if dtype.kind == "O":
            if not isinstance(data, list) or len(data) != count:
                got = f"{len(data)} items" if isinstance(data, list) else brief(data)
                raise LayoutError(
                    f"{where} of objects {list(shape)[:8]} holds {got}; expected a list of {count} items "
                    "(object arrays are never rebuilt: kept as a list)"
                )
            return ObjectArray(data, shape)
        if not isinstance(data, (bytes, bytearray)):
            raise LayoutError(f"{where} {dtype} {list(shape)[:8]} holds {brief(data)}; expected its bytes")
        if len(data) != count * dtype.itemsize:
            raise LayoutError(
                f"{where} {dtype} {list(shape)[:8]} holds {len(data)} bytes; expected "
                f"{count} × {dtype.itemsize} = {count * dtype.itemsize}"
            )
        flat = np.frombuffer(bytes(data), dtype=dtype)
        array = flat.reshape(shape, order="F" if fortran is True else "C")
        return array.astype(dtype.newbyteorder("="), copy=False) if dtype.kind in "biufc" else array


def _numpy_globals(source: str) -> dict[tuple[str, str], Any]:
    """numpy's reconstructors as a pickle names them (numpy 1.x ``numpy.core``, numpy 2 ``numpy._core``),
    each replaced by a checking stand-in."""

    def reconstruct(cls: Any, shape: Any = (0,), typecode: Any = b"b") -> _PendingArray:
        if cls is not _NDARRAY:
            raise LayoutError(f"{source}: numpy _reconstruct of {brief(cls)}; expected numpy.ndarray")
        return _PendingArray(source)

    def scalar(dtype: Any, data: Any = b"") -> Any:
        dtype = _resolve_dtype(dtype, f"{source}: numpy scalar")
        if dtype.kind not in _ARRAY_KINDS or not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise LayoutError(
                f"{source}: numpy scalar {dtype} of {brief(data)}; "
                f"expected {dtype.itemsize} bytes of a number"
            )
        return np.frombuffer(data, dtype=dtype)[0].item()

    def dtype(*args: Any) -> _PendingDtype:
        return _PendingDtype(source, *args[:1])

    allowed: dict[tuple[str, str], Any] = {("numpy", "dtype"): dtype, ("numpy", "ndarray"): _NDARRAY}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
        allowed[(module, "scalar")] = scalar
    return allowed


def _safe_key(key: Any, depth: int) -> bool:
    """Whether ``key`` may be hashed into a dict or set built from a file (see ``SafeUnpickler._key``)."""
    if key is None or isinstance(key, (str, bytes, bool)):
        return True
    if isinstance(key, (int, float)):
        return not abs(key) >= 2**61  # NaN passes: each NaN hashes by its identity
    if isinstance(key, tuple) and depth > 0:
        return len(key) <= 8 and all(_safe_key(k, depth - 1) for k in key)
    return False


def _safe_set(items: Any = ()) -> set[Any]:
    """``set(items)``, one item at a time, items whose hashes cannot be aimed (``_safe_key``)."""
    out: set[Any] = set()
    for item in _iterable(items, "builtins.set"):
        if not _safe_key(item, 2):
            raise LayoutError(f"builtins.set: item {brief(item)} refused; expected strings or small numbers")
        out.add(item)
    return out


def _safe_frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_safe_set(items))


def _safe_ordered_dict(items: Any = ()) -> OrderedDict[Any, Any]:
    out: OrderedDict[Any, Any] = OrderedDict()
    pairs = items.items() if isinstance(items, dict) else _iterable(items, "collections.OrderedDict")
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _safe_key(pair[0], 2)):
            raise LayoutError(f"collections.OrderedDict: item {brief(pair)}; expected (key, value)")
        out[pair[0]] = pair[1]
    return out


def _iterable(items: Any, name: str) -> Any:
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise LayoutError(f"{name}: argument {brief(items)}; expected a list or tuple")
    return items


class _Bounded:
    """A file's ``read``/``readline`` for the unpickler: a read of more than the bytes left is
    refused before anything is allocated (a pickle declaring a 4 GiB string in 100 bytes)."""

    def __init__(self, handle: Any, size: int, source: str) -> None:
        self.handle, self.left, self.source = handle, size, source

    def read(self, n: int) -> bytes:
        if n > self.left:
            raise LayoutError(
                f"{self.source}: the pickle declares {n} bytes where {self.left} are left; "
                "expected a complete pickle (truncated or hostile)"
            )
        data = self.handle.read(n)
        self.left -= len(data)
        return data  # type: ignore[no-any-return]

    def readline(self) -> bytes:
        line = self.handle.readline()
        self.left -= len(line)
        return line  # type: ignore[no-any-return]


class SafeUnpickler(pickle._Unpickler):
    """An unpickler that resolves only allowlisted globals (see the module docstring).

    ``source`` names the file in every error. ``archive`` (a torch zip archive and its record
    prefix) serves ``torch.save``'s persistent storage ids; without one they are refused.
    ``size``: the bytes of ``file`` left to read (default: what is left of a seekable file).
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    # What pickle._Unpickler sets up in ``__init__`` and ``load`` (typeshed does not declare it).
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    append: Callable[[Any], None]
    stack: list[Any]
    memo: dict[Any, Any]
    pop_mark: Callable[[], list[Any]]

    def __init__(
        self,
        file: Any,
        *,
        source: str,
        stand_ins: StandIns | None = None,
        archive: _Archive | None = None,
        big_endian: bool = False,
        size: int | None = None,
    ) -> None:
        if size is None:
            position = file.tell()
            size = file.seek(0, io.SEEK_END) - position
            file.seek(position)
        super().__init__(_Bounded(file, size, source))
        self.source = source
        self.size = size
        self.archive = archive
        self.big_endian = big_endian
        self._storages: dict[str, _Storage] = {}
        self._built: dict[int, Any] = {}
        """``id`` of a pending array or dtype → what its ``BUILD`` made (memo references resolve to it)."""
        self._pending: list[Any] = []
        """The pending objects themselves, alive while their ids key ``_built``."""
        self.allowed: dict[tuple[str, str], Any] = {
            ("collections", "OrderedDict"): _safe_ordered_dict,
            ("builtins", "set"): _safe_set,
            ("builtins", "frozenset"): _safe_frozenset,
            ("__builtin__", "set"): _safe_set,
            ("__builtin__", "frozenset"): _safe_frozenset,
            ("_codecs", "encode"): _latin1,
            ("torch", "device"): _torch_device,
            ("torch", "Size"): self._size,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_v3,
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): self._tensordict,
            ("torch.storage", "UntypedStorage"): _StorageKind("u1"),
            ("torch", "UntypedStorage"): _StorageKind("u1"),
            **{("torch", name): _StorageKind(code) for name, code in _STORAGE_KINDS.items()},
            **{("torch", name): _TorchDtype(code) for name, code in _TORCH_DTYPES.items()},
            **_numpy_globals(source),
            **(stand_ins or {}),
        }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise LayoutError(
                f"{self.source}: refused global {_printable(module)}.{_printable(name)}: not in the "
                "allowlist of this importer (untrusted pickle; nothing in it was run)"
            ) from None

    # BUILD applies a state only to a framework stand-in, a numpy array or a dtype (each checks it).
    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, (_PendingArray, _PendingDtype)):
            if id(inst) in self._built:
                raise LayoutError(f"{self.source}: a numpy object built twice; expected one BUILD")
            built = inst.build(state)
            self._built[id(inst)] = built
            self._pending.append(inst)
            self.stack[-1] = built
        elif isinstance(inst, Pickled):
            inst.__setstate__(state)
        else:
            raise LayoutError(
                f"{self.source}: BUILD on {brief(inst)} refused; expected a state for a framework class "
                "or a numpy array"
            )

    def _memo_get(self, index: Any) -> None:
        try:
            value = self.memo[index]
        except KeyError:
            raise LayoutError(f"{self.source}: memo {brief(index)} read before it was written") from None
        self.append(
            self._built.get(id(value), value) if isinstance(value, (_PendingArray, _PendingDtype)) else value
        )

    def load_get(self) -> None:
        self._memo_get(int(self.readline()[:-1]))

    def load_binget(self) -> None:
        self._memo_get(self.read(1)[0])

    def load_long_binget(self) -> None:
        self._memo_get(struct.unpack("<I", self.read(4))[0])

    def load_bytearray8(self) -> None:
        (length,) = struct.unpack("<Q", self.read(8))
        if length > self.size:  # bytearray(length) would be allocated before the read
            raise LayoutError(
                f"{self.source}: the pickle declares a byte array of {length} bytes in a file of "
                f"{self.size}; expected a complete pickle (truncated or hostile)"
            )
        self.append(bytearray(self.read(length)))

    def load_persid(self) -> None:
        raise LayoutError(f"{self.source}: a text persistent id; expected a plain pickle or a torch archive")

    def load_next_buffer(self) -> None:
        raise LayoutError(f"{self.source}: an out-of-band buffer; expected the data inside the pickle")

    # Keys of dicts and items of sets: only values whose hashes a file cannot aim at one bucket (a
    # million integers k·(2**61 − 1) share one hash: inserting them is quadratic, minutes of CPU).
    def _key(self, key: Any) -> Any:
        if not _safe_key(key, 2):
            raise LayoutError(
                f"{self.source}: a dict key or set item {brief(key)} refused; expected strings, bytes or "
                "integers below 2**61"
            )
        return key

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append({self._key(items[i]): items[i + 1] for i in range(0, len(items), 2)})

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self._key(self.stack.pop())
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[self._key(items[i])] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if not isinstance(target, set):
            raise LayoutError(f"{self.source}: ADDITEMS on {brief(target)}; expected a set")
        for item in items:
            target.add(self._key(item))

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self.append(frozenset(self._key(item) for item in items))

    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.GET[0]] = load_get
    dispatch[pickle.BINGET[0]] = load_binget
    dispatch[pickle.LONG_BINGET[0]] = load_long_binget
    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8
    dispatch[pickle.PERSID[0]] = load_persid
    dispatch[pickle.NEXT_BUFFER[0]] = load_next_buffer

    def _size(self, items: Any = ()) -> tuple[Any, ...]:
        """``torch.Size(...)``: a tuple of sizes."""
        return _shape(tuple(_iterable(items, "torch.Size")), f"{self.source}: torch.Size")

    def persistent_load(self, pid: Any) -> Any:
        if self.archive is None:
            raise LayoutError(f"{self.source}: persistent id {brief(pid)} refused; expected a plain pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[0], str) and pid[0] == "storage"):
            raise LayoutError(
                f"{self.source}: persistent id {brief(pid)}; expected ('storage', kind, key, device, n)"
            )
        _, kind, key, _device, _numel = pid
        if not isinstance(kind, _StorageKind) or not isinstance(key, str) or len(key) > 64:
            raise LayoutError(
                f"{self.source}: storage {brief(kind)} {brief(key)}; expected a torch storage kind and a key"
            )
        if key not in self._storages:
            data = self.archive.record(f"data/{key}", self.source)
            self._storages[key] = _Storage(data, str(kind))
        return self._storages[key]

    def _rebuild(
        self, storage: Any, offset: Any, size: Any, stride: Any, code: str | None
    ) -> npt.NDArray[Any]:
        """The tensor ``storage[offset:]`` viewed with ``size``/``stride``, every index checked first:
        a view of the storage's bytes where the tensor is the storage's C-ordered prefix, else a copy."""
        if not isinstance(storage, _Storage):
            raise LayoutError(f"{self.source}: tensor without a storage record; expected a torch archive")
        code = storage.code if code is None else code
        element = _element(code, self.big_endian)
        if len(storage.data) % element.itemsize:
            raise LayoutError(
                f"{self.source}: storage of {len(storage.data)} bytes; expected whole {element} elements"
            )
        flat = np.frombuffer(storage.data, dtype=element)
        where = f"{self.source}: tensor"
        shape = _shape(tuple(size) if isinstance(size, (tuple, list)) else size, f"{where} size")
        strides = _shape(tuple(stride) if isinstance(stride, (tuple, list)) else stride, f"{where} stride")
        if (
            len(shape) != len(strides)
            or not isinstance(offset, int)
            or isinstance(offset, bool)
            or offset < 0
        ):
            raise LayoutError(
                f"{where} size {shape} / stride {strides} / offset {brief(offset)}; "
                "expected one stride per dimension and an offset >= 0"
            )
        if math.prod(shape) > flat.size:
            raise LayoutError(
                f"{where} size {shape} declares more elements than the {flat.size} of its "
                "storage; expected a tensor within its storage"
            )
        if 0 in shape:
            array = np.zeros(shape, dtype=element)
        else:
            last = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
            if last >= flat.size:
                raise LayoutError(
                    f"{where} size {shape} stride {strides} offset {offset} "
                    f"reaches element {last}; expected < {flat.size}, the elements of its storage"
                )
            contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
            if all(n == 1 or s == c for n, s, c in zip(shape, strides, contiguous, strict=True)):
                array = flat[offset : offset + math.prod(shape)].reshape(shape)  # a view: no copy
            else:
                view = np.lib.stride_tricks.as_strided(
                    flat[offset:],
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
            raise LayoutError(f"{self.source}: tensor dtype {brief(dtype)}; expected a torch dtype")
        return self._rebuild(storage, offset, size, stride, str(dtype))

    def _tensordict(self, metadata: Any, storage: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
        """A consolidated ``TensorDict`` (tensordict >= 0.5: one byte storage and per-leaf
        ``(dtype, shape, start, stop, pad)``) as a plain dict: arrays, nested dicts, non-tensor data."""
        meta = expect(metadata, dict, self.source, f"{prefix}tensordict metadata", "a dict")
        if depth > MAX_DIMS:
            raise LayoutError(
                f"{self.source}: tensordict {prefix[:80]!r} nested {depth} deep; expected <= {MAX_DIMS}"
            )
        if not (isinstance(storage, np.ndarray) and storage.dtype == np.uint8 and storage.ndim == 1):
            raise LayoutError(f"{self.source}: tensordict storage is {brief(storage)}; expected flat bytes")
        out: dict[str, Any] = {}
        for key, entry in expect(
            meta.get("non_tensors", {}), dict, self.source, f"{prefix}non_tensors", "a dict"
        ).items():
            out[key] = entry[0] if isinstance(entry, tuple) and entry else entry
        leaves = expect(meta.get("leaves", {}), dict, self.source, f"{prefix}leaves", "a dict of leaves")
        for key, leaf in leaves.items():
            field = f"{prefix}{brief(key)}"
            if not (
                isinstance(leaf, tuple)
                and len(leaf) == 5
                and all(isinstance(x, int) and not isinstance(x, bool) for x in leaf[2:4])
            ):
                raise LayoutError(
                    f"{self.source}: field {field!r} is {brief(leaf)}; "
                    "expected (dtype, shape, start, stop, pad)"
                )
            dtype, shape, start, stop, _pad = leaf
            if not 0 <= start <= stop <= len(storage):
                raise LayoutError(
                    f"{self.source}: field {field!r} spans bytes [{brief(start)}, {brief(stop)}); "
                    f"expected a span within the {len(storage)} bytes of the storage"
                )
            shape = tuple(shape) if isinstance(shape, (list, tuple)) else shape
            out[key] = view_bytes(storage[start:stop], dtype, shape, self.source, field)
        for key, sub in meta.items():
            if key not in ("non_tensors", "leaves", "cls", "cls_metadata", "size"):
                out[key] = self._tensordict(sub, storage, f"{prefix}{brief(key)}.", depth + 1)
        return out


def expect(value: Any, kind: type | tuple[type, ...], source: str, field: str, what: str) -> Any:
    """``value`` when it is a ``kind``, else a one-line ``LayoutError`` naming file, field and expectation.

    What a pickle holds is whatever it claims; each field an importer reads is checked through here.
    """
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise LayoutError(f"{source}: field {field!r} is {type(value).__name__}; expected {what}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def view_bytes(buffer: Any, dtype: Any, shape: Any, source: str, field: str) -> npt.NDArray[Any]:
    """The ``dtype`` (a torch dtype name, ``"torch.int16"`` or ``"int16"``) array of ``shape`` held
    in the bytes ``buffer`` (bytes or a uint8 array), as frameworks serialize tensors by hand."""
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in _TORCH_DTYPES:
        raise LayoutError(
            f"{source}: field {field!r} has dtype {brief(dtype)}; expected a numeric torch dtype"
        )
    shape = _shape(tuple(shape) if isinstance(shape, list) else shape, f"{source}: field {field!r}")
    if isinstance(buffer, (bytes, bytearray)):
        raw = np.frombuffer(buffer, dtype=np.uint8)
    elif isinstance(buffer, np.ndarray):
        raw = buffer
    else:
        raise LayoutError(f"{source}: field {field!r} holds {brief(buffer)}; expected flat bytes")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise LayoutError(f"{source}: field {field!r} holds {brief(raw)}; expected flat bytes")
    code = _TORCH_DTYPES[name]
    element = _element(code, big_endian=False)
    nbytes = math.prod(shape) * element.itemsize
    if raw.size < nbytes:
        raise LayoutError(
            f"{source}: field {field!r} holds {raw.size} bytes; "
            f"expected {nbytes} for {name} {list(shape)[:8]}"
        )
    array = np.frombuffer(raw[:nbytes].tobytes(), dtype=element).reshape(shape)
    return _widen_bfloat16(array) if code == _BFLOAT16 else array


def _unpickle(unpickler: SafeUnpickler) -> Any:
    try:
        return unpickler.load()
    except LayoutError:
        raise
    except Exception as err:  # any malformed input: one line naming the file
        raise LayoutError(
            f"{unpickler.source}: not a readable pickle ({type(err).__name__}: {_first_line(err)})"
        ) from None


def _printable(text: Any) -> str:
    """A name from a file as printable text (escapes for anything else), at most 100 characters."""
    return str(text)[:100].encode("unicode_escape").decode("ascii")


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:200]


def load(path: str | os.PathLike[str], stand_ins: StandIns | None = None) -> Any:
    """The object pickled in ``path`` (a regular file), read with ``SafeUnpickler`` and the importer's
    ``stand_ins``."""
    with open_regular(path) as handle:
        return _unpickle(SafeUnpickler(handle, source=str(path), stand_ins=stand_ins, size=file_size(handle)))


# --- torch.save archives ---------------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


class _Archive:
    """A ``torch.save`` zip archive: its records read only when stored, unencrypted, inside the file
    and CRC-correct; every zipfile failure one ``LayoutError`` naming the record."""

    def __init__(self, file: Any, size: int, source: str) -> None:
        self.file, self.size, self.source = file, size, source
        try:
            self.zip = zipfile.ZipFile(file)
            names = self.zip.namelist()
        except Exception as err:  # BadZipFile, and whatever a damaged directory makes zipfile raise
            raise LayoutError(
                f"{source}: not a torch.save archive ({type(err).__name__}: {_first_line(err)}: truncated, "
                "or not torch.save output); expected a complete torch.save file (zip format, torch >= 1.6)"
            ) from None
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise LayoutError(f"{source}: {len(pickles)} data.pkl records in the archive; expected one")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.names = set(names)

    def record(self, name: str, where: str) -> bytes:
        """The bytes of record ``prefix + name``, checked before and as they are read."""
        full = self.prefix + name
        try:
            info = self.zip.getinfo(full)
        except KeyError:
            raise LayoutError(f"{where}: record {brief(name)} missing from the archive") from None
        if info.compress_type != zipfile.ZIP_STORED:  # torch stores; a compressed record could be a bomb
            raise LayoutError(
                f"{where}: record {name} is compressed (method {info.compress_type}); expected stored bytes"
            )
        if info.flag_bits & 0x1:
            raise LayoutError(f"{where}: record {name} is encrypted; expected plain stored bytes")
        if info.compress_size != info.file_size or info.header_offset + info.file_size > self.size:
            raise LayoutError(
                f"{where}: record {name} declares {info.file_size} bytes at offset {info.header_offset} "
                f"of a {self.size}-byte file; expected a record inside the file"
            )
        try:
            return self.zip.read(info)
        except Exception as err:  # a bad CRC, a local header that disagrees, a short read
            raise LayoutError(
                f"{where}: record {name} unreadable ({type(err).__name__}: {_first_line(err)}); "
                "expected an intact torch.save archive"
            ) from None

    def load(self, stand_ins: StandIns | None) -> Any:
        order = "little"
        if self.prefix + "byteorder" in self.names:
            raw = self.record("byteorder", self.source)
            order = raw.decode("latin1").strip() if len(raw) <= 16 else "?"
        if order not in ("little", "big"):
            raise LayoutError(f"{self.source}: byteorder {brief(order)}; expected 'little' or 'big'")
        data = self.record("data.pkl", self.source)
        unpickler = SafeUnpickler(
            io.BytesIO(data), source=self.source, stand_ins=stand_ins, archive=self,
            big_endian=order == "big", size=len(data),
        )  # fmt: skip
        return _unpickle(unpickler)


def load_torch_bytes(data: bytes, source: str, stand_ins: StandIns | None = None) -> Any:
    """The object in ``data``, bytes written by ``torch.save`` (zip format), tensors as numpy arrays."""
    return _Archive(io.BytesIO(data), len(data), source).load(stand_ins)


def load_torch(path: str | os.PathLike[str], stand_ins: StandIns | None = None) -> Any:
    """The object in the ``torch.save`` file ``path`` (a regular file), tensors as numpy arrays; each
    storage is read from the file as it is needed."""
    with open_regular(path) as handle:
        return _Archive(handle, file_size(handle), str(path)).load(stand_ins)
