"""What ``safe_pickle``'s unpickler hands out and rebuilds: framework objects as ``Pickled``
stand-ins, numpy arrays and dtypes rebuilt from checked bytes (an object array as an
``ObjectArray``), bounded containers whose keys cannot aim a hash, and ``Bounded``, the file reader
that refuses a declared length past the bytes left.

Imports ``harness.audit``'s inputs and layout only; ``safe_pickle`` and ``torch_format`` import it.
"""

from __future__ import annotations

import codecs
import functools
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout.inputs import brief
from harness.audit.layout.schema import LayoutError

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


class Rebuild:
    """A framework rebuild function ``module.name(cls, state)`` as a stand-in: the call returns an
    instance of ``cls`` (itself a stand-in) holding ``state``, as the function would. The unpickler
    calls it with the file being read first (``SafeUnpickler.find_class``), so a refusal names it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, source: str, *args: Any) -> Pickled:
        if not args or not (isinstance(args[0], type) and issubclass(args[0], Pickled)):
            got = brief(args[0]) if args else "nothing"
            raise LayoutError(f"{source}: {self.module}.{self.name}: expected a class argument, got {got}")
        obj = args[0]()
        obj.__setstate__(args[1] if len(args) > 1 else None)
        return obj


def stand_in_function(module: str, name: str) -> tuple[tuple[str, str], Rebuild]:
    """A ``StandIns`` entry for a framework rebuild function ``module.name(cls, state)`` (``Rebuild``)."""
    return (module, name), Rebuild(module, name)


def latin1(source: str, text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes: latin-1 only, never a codec by name; a
    refusal names ``source``, the file."""
    if encoding not in ("latin1", "latin-1"):
        raise LayoutError(
            f"{source}: bytes (_codecs.encode) with encoding {brief(encoding)} refused; expected 'latin1'"
        )
    if not isinstance(text, str):
        raise LayoutError(f"{source}: bytes (_codecs.encode) of {brief(text)}; expected a latin-1 string")
    return codecs.encode(text, "latin1")


ARRAY_KINDS = "biufcUS"
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


NDARRAY = _NdarrayClass()


MAX_NBYTES = 2**63 - 1
"""numpy's bound on ``itemsize`` × the sizes of an array's non-zero dimensions (``npy_intp``)."""


def shape_of(value: Any, where: str, itemsize: int = 1) -> tuple[int, ...]:
    """``value`` as a shape numpy can make an array of with elements of ``itemsize`` bytes.

    numpy multiplies the itemsize by every non-zero size and refuses a product past ``MAX_NBYTES``
    even when a size 0 makes the array empty (``(2**32, 2**32, 0)`` cannot be reshaped into), so such
    a shape is refused here, naming ``where``, rather than as numpy's ``ValueError`` later.
    ``itemsize`` 0 checks the sizes only (a tensor's strides)."""
    if not (
        isinstance(value, tuple)
        and len(value) <= MAX_DIMS
        and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in value)
    ):
        raise LayoutError(f"{where}: shape {brief(value)}; expected a tuple of at most {MAX_DIMS} sizes >= 0")
    if itemsize * math.prod(n for n in value if n) > MAX_NBYTES:
        raise LayoutError(
            f"{where}: shape {list(value)[:8]} of {itemsize}-byte elements overflows int64 "
            f"(its non-zero sizes × {itemsize} > 2**63 − 1); expected a shape an array can have"
        )
    return value


class PendingDtype:
    """``numpy.dtype(code, align, copy)`` before its ``BUILD`` state: the code, checked."""

    __slots__ = ("dtype", "source")
    BRIEF = "a numpy dtype without its state"
    """What ``inputs.brief`` says of one that is left where a value belongs."""

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
        if dtype.kind not in ARRAY_KINDS + "O" or dtype.fields is not None or dtype.subdtype is not None:
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


def resolve_dtype(value: Any, where: str) -> np.dtype[Any]:
    if isinstance(value, PendingDtype):  # a dtype pickled without state
        return value.dtype
    if isinstance(value, np.dtype):
        return value
    raise LayoutError(f"{where}: array dtype is {brief(value)}; expected a numpy dtype")


class PendingArray:
    """What ``_reconstruct(ndarray, (0,), b'b')`` returns: an array waiting for its ``BUILD`` state."""

    __slots__ = ("source",)
    BRIEF = "a numpy array without its contents (its BUILD state never came)"
    """What ``inputs.brief`` says of one: the user's terms, not this class's name."""

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
        dtype = resolve_dtype(dtype, where)
        shape = shape_of(shape, where, dtype.itemsize)
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


def numpy_globals(source: str) -> dict[tuple[str, str], Any]:
    """numpy's reconstructors as a pickle names them (numpy 1.x ``numpy.core``, numpy 2 ``numpy._core``),
    each replaced by a checking stand-in."""

    def reconstruct(cls: Any, shape: Any = (0,), typecode: Any = b"b") -> PendingArray:
        if cls is not NDARRAY:
            raise LayoutError(f"{source}: numpy _reconstruct of {brief(cls)}; expected numpy.ndarray")
        return PendingArray(source)

    def scalar(dtype: Any, data: Any = b"") -> Any:
        dtype = resolve_dtype(dtype, f"{source}: numpy scalar")
        if dtype.kind not in ARRAY_KINDS or not isinstance(data, bytes) or len(data) != dtype.itemsize:
            raise LayoutError(
                f"{source}: numpy scalar {dtype} of {brief(data)}; "
                f"expected {dtype.itemsize} bytes of a number"
            )
        return np.frombuffer(data, dtype=dtype)[0].item()

    def dtype(*args: Any) -> PendingDtype:
        return PendingDtype(source, *args[:1])

    allowed: dict[tuple[str, str], Any] = {("numpy", "dtype"): dtype, ("numpy", "ndarray"): NDARRAY}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
        allowed[(module, "scalar")] = scalar
    return allowed


def safe_key(key: Any, depth: int) -> bool:
    """Whether ``key`` may be hashed into a dict or set built from a file (see ``SafeUnpickler._key``)."""
    if key is None or isinstance(key, (str, bytes, bool)):
        return True
    if isinstance(key, (int, float)):
        return not abs(key) >= 2**61  # NaN passes: each NaN hashes by its identity
    if isinstance(key, tuple) and depth > 0:
        return len(key) <= 8 and all(safe_key(k, depth - 1) for k in key)
    return False


def safe_set(source: str, items: Any = ()) -> set[Any]:
    """``set(items)``, one item at a time, items whose hashes cannot be aimed (``safe_key``); a
    refusal names ``source``, the file."""
    out: set[Any] = set()
    for item in _iterable(items, "a set (builtins.set)", source):
        if not safe_key(item, 2):
            raise LayoutError(
                f"{source}: a set (builtins.set) holds {brief(item)}; expected strings or small numbers"
            )
        out.add(item)
    return out


def safe_frozenset(source: str, items: Any = ()) -> frozenset[Any]:
    return frozenset(safe_set(source, items))


def safe_ordered_dict(source: str, items: Any = ()) -> OrderedDict[Any, Any]:
    """``OrderedDict(items)`` with keys as ``safe_set`` takes them; a refusal names ``source``."""
    out: OrderedDict[Any, Any] = OrderedDict()
    what = "an ordered dict (collections.OrderedDict)"
    pairs = items.items() if isinstance(items, dict) else _iterable(items, what, source)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and safe_key(pair[0], 2)):
            raise LayoutError(f"{source}: {what} holds {brief(pair)}; expected (key, value) with a plain key")
        out[pair[0]] = pair[1]
    return out


def builtin_globals(source: str) -> dict[tuple[str, str], Any]:
    """The builtins a pickle may call (``set``, ``frozenset``, ``OrderedDict``, ``_codecs.encode``),
    each bound to ``source`` (the file) so that a refusal names it."""
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): functools.partial(safe_ordered_dict, source),
        ("_codecs", "encode"): functools.partial(latin1, source),
    }
    for module in ("builtins", "__builtin__"):
        allowed[(module, "set")] = functools.partial(safe_set, source)
        allowed[(module, "frozenset")] = functools.partial(safe_frozenset, source)
    return allowed


def _iterable(items: Any, what: str, source: str) -> Any:
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise LayoutError(f"{source}: {what} made of {brief(items)}; expected a list or tuple")
    return items


class Bounded:
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


def first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:200]
