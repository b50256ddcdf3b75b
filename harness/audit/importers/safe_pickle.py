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
The unpickler is Python's own (``pickle._Unpickler``) reading through ``Bounded``: every length
the pickle declares (bytes, strings, frames, byte arrays) is checked against the bytes left in the
file before anything is allocated, ``BUILD`` applies only to the stand-ins above, and a long load
can be interrupted by the file's time budget (``harness.audit.layout.inputs.time_budget``).

Tensors in a ``torch.save`` archive (slime's ``.pt`` files, verl's ``DataProto`` batch, SkyRL's
bfloat16 fallback) are read by ``load_torch``/``load_torch_bytes`` with the same unpickler: records
must be stored (torch never compresses), unencrypted, inside the file and CRC-correct, and each
storage is bounds-checked before any strided view is made.

What the unpickler hands out and rebuilds is in ``pickle_values`` (``Pickled``, ``stand_in``,
``ObjectArray``, ``Bounded``), torch's format and archives in ``torch_format``; this module imports
both, and ``harness.audit``'s inputs and layout.
"""

from __future__ import annotations

import functools
import io
import math
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from harness.audit.importers.pickle_values import (
    MAX_DIMS,
    Bounded,
    PendingArray,
    PendingDtype,
    Pickled,
    Rebuild,
    StandIns,
    _iterable,
    builtin_globals,
    first_line,
    numpy_globals,
    safe_key,
    shape_of,
)
from harness.audit.importers.torch_format import (
    BFLOAT16,
    STORAGE_KINDS,
    TORCH_DTYPES,
    Storage,
    StorageKind,
    TorchArchive,
    TorchDtype,
    element_dtype,
    torch_device,
    view_bytes,
    widen_bfloat16,
    widened,
)
from harness.audit.layout.inputs import brief, file_size, kind_name, open_regular
from harness.audit.layout.schema import LayoutError


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
        archive: TorchArchive | None = None,
        big_endian: bool = False,
        size: int | None = None,
    ) -> None:
        if size is None:
            position = file.tell()
            size = file.seek(0, io.SEEK_END) - position
            file.seek(position)
        super().__init__(Bounded(file, size, source))
        self.source = source
        self.size = size
        self.archive = archive
        self.big_endian = big_endian
        self._storages: dict[str, Storage] = {}
        self._built: dict[int, Any] = {}
        """``id`` of a pending array or dtype → what its ``BUILD`` made (memo references resolve to it)."""
        self._pending: list[Any] = []
        """The pending objects themselves, alive while their ids key ``_built``."""
        self.allowed: dict[tuple[str, str], Any] = {
            **builtin_globals(source),
            ("torch", "device"): functools.partial(torch_device, source),
            ("torch", "Size"): self._size,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_v3,
            ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): self._tensordict,
            ("torch.storage", "UntypedStorage"): StorageKind("u1"),
            ("torch", "UntypedStorage"): StorageKind("u1"),
            **{("torch", name): StorageKind(code) for name, code in STORAGE_KINDS.items()},
            **{("torch", name): TorchDtype(code) for name, code in TORCH_DTYPES.items()},
            **numpy_globals(source),
            **(stand_ins or {}),
        }

    def find_class(self, module: str, name: str) -> Any:
        try:
            found = self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise LayoutError(
                f"{self.source}: refused global {_printable(module)}.{_printable(name)}: not in the "
                "allowlist of this importer (untrusted pickle; nothing in it was run)"
            ) from None
        # A framework rebuild function's refusal names the file being read.
        return functools.partial(found, self.source) if isinstance(found, Rebuild) else found

    # BUILD applies a state only to a framework stand-in, a numpy array or a dtype (each checks it).
    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, (PendingArray, PendingDtype)):
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
            self._built.get(id(value), value) if isinstance(value, (PendingArray, PendingDtype)) else value
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
        if not safe_key(key, 2):
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
        return shape_of(tuple(_iterable(items, "torch.Size", self.source)), f"{self.source}: torch.Size")

    def persistent_load(self, pid: Any) -> Any:
        if self.archive is None:
            raise LayoutError(f"{self.source}: persistent id {brief(pid)} refused; expected a plain pickle")
        if not (isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[0], str) and pid[0] == "storage"):
            raise LayoutError(
                f"{self.source}: persistent id {brief(pid)}; expected ('storage', kind, key, device, n)"
            )
        _, kind, key, _device, _numel = pid
        if not isinstance(kind, StorageKind) or not isinstance(key, str) or len(key) > 64:
            raise LayoutError(
                f"{self.source}: storage {brief(kind)} {brief(key)}; expected a torch storage kind and a key"
            )
        if key not in self._storages:
            data = self.archive.record(f"data/{key}", self.source)
            self._storages[key] = Storage(data, str(kind))
        return self._storages[key]

    def _rebuild(
        self, storage: Any, offset: Any, size: Any, stride: Any, code: str | None
    ) -> npt.NDArray[Any]:
        """The tensor ``storage[offset:]`` viewed with ``size``/``stride``, every index checked first:
        a view of the storage's bytes where the tensor is the storage's C-ordered prefix, else a copy."""
        if not isinstance(storage, Storage):
            raise LayoutError(f"{self.source}: tensor without a storage record; expected a torch archive")
        code = storage.code if code is None else code
        element = element_dtype(code, self.big_endian)
        if len(storage.data) % element.itemsize:
            raise LayoutError(
                f"{self.source}: storage of {len(storage.data)} bytes; expected whole {element} elements"
            )
        flat = np.frombuffer(storage.data, dtype=element)
        where = f"{self.source}: tensor"
        shape = shape_of(
            tuple(size) if isinstance(size, (tuple, list)) else size, f"{where} size", widened(element, code)
        )
        strides = shape_of(
            tuple(stride) if isinstance(stride, (tuple, list)) else stride, f"{where} stride", itemsize=0
        )  # strides, not sizes: their product bounds nothing
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
        return widen_bfloat16(array) if code == BFLOAT16 else array

    def _rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> npt.NDArray[Any]:
        return self._rebuild(storage, offset, size, stride, None)

    def _rebuild_v3(
        self, storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_: Any
    ) -> npt.NDArray[Any]:
        if not isinstance(dtype, TorchDtype):
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
        raise LayoutError(f"{source}: field {field!r} is {kind_name(value)}; expected {what}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _unpickle(unpickler: SafeUnpickler) -> Any:
    try:
        return unpickler.load()
    except LayoutError:
        raise
    except Exception as err:  # any malformed input: one line naming the file
        raise LayoutError(
            f"{unpickler.source}: not a readable pickle ({type(err).__name__}: {first_line(err)})"
        ) from None


def _printable(text: Any) -> str:
    """A name from a file as printable text (escapes for anything else), at most 100 characters."""
    return str(text)[:100].encode("unicode_escape").decode("ascii")


def load(path: str | os.PathLike[str], stand_ins: StandIns | None = None) -> Any:
    """The object pickled in ``path`` (a regular file), read with ``SafeUnpickler`` and the importer's
    ``stand_ins``."""
    with open_regular(path) as handle:
        return _unpickle(SafeUnpickler(handle, source=str(path), stand_ins=stand_ins, size=file_size(handle)))


# --- torch.save archives ---------------------------------------------------------------------------


def _load_archive(archive: TorchArchive, stand_ins: StandIns | None) -> Any:
    """The object in ``archive``'s ``data.pkl``, its storages served from the archive's records."""
    order = "little"
    if archive.prefix + "byteorder" in archive.names:
        raw = archive.record("byteorder", archive.source)
        order = raw.decode("latin1").strip() if len(raw) <= 16 else "?"
    if order not in ("little", "big"):
        raise LayoutError(f"{archive.source}: byteorder {brief(order)}; expected 'little' or 'big'")
    data = archive.record("data.pkl", archive.source)
    unpickler = SafeUnpickler(
        io.BytesIO(data), source=archive.source, stand_ins=stand_ins, archive=archive,
        big_endian=order == "big", size=len(data),
    )  # fmt: skip
    return _unpickle(unpickler)


def load_torch_bytes(data: bytes, source: str, stand_ins: StandIns | None = None) -> Any:
    """The object in ``data``, bytes written by ``torch.save`` (zip format), tensors as numpy arrays."""
    return _load_archive(TorchArchive(io.BytesIO(data), len(data), source), stand_ins)


def load_torch(path: str | os.PathLike[str], stand_ins: StandIns | None = None) -> Any:
    """The object in the ``torch.save`` file ``path`` (a regular file), tensors as numpy arrays; each
    storage is read from the file as it is needed."""
    with open_regular(path) as handle:
        return _load_archive(TorchArchive(handle, file_size(handle), str(path)), stand_ins)
