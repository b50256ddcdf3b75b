"""torch's tensor format read without torch: dtype and storage names as numpy codes, tensors
serialized by hand (``view_bytes``), and ``TorchArchive``, a ``torch.save`` zip archive whose
records are read only when stored, unencrypted, inside the file and CRC-correct.

Imports ``harness.audit``'s inputs and layout and ``pickle_values``; ``safe_pickle`` unpickles
an archive's ``data.pkl`` (``safe_pickle.load_torch``).
"""

from __future__ import annotations

import math
import struct
import zipfile
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from harness.audit.importers.pickle_values import first_line, shape_of
from harness.audit.layout.inputs import BFloat16Array, brief
from harness.audit.layout.schema import LayoutError

BFLOAT16 = "bfloat16"

TORCH_DTYPES: dict[str, str] = {
    "float64": "f8", "double": "f8", "float32": "f4", "float": "f4", "float16": "f2", "half": "f2",
    "bfloat16": BFLOAT16, "int64": "i8", "long": "i8", "int32": "i4", "int": "i4", "int16": "i2",
    "short": "i2", "int8": "i1", "uint8": "u1", "uint16": "u2", "uint32": "u4", "uint64": "u8", "bool": "?",
}  # fmt: skip
"""torch dtype names → numpy dtype codes (bfloat16 is widened to float32 when read)."""

STORAGE_KINDS: dict[str, str] = {
    "DoubleStorage": "f8", "FloatStorage": "f4", "HalfStorage": "f2", "BFloat16Storage": BFLOAT16,
    "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?",
}  # fmt: skip


class TorchDtype(str):
    """``torch.<dtype>`` as a pickle names it: the numpy code of its elements (immutable, no
    attributes: a pickle's ``BUILD`` cannot change what it means)."""

    __slots__ = ()


class StorageKind(str):
    """``torch.<Kind>Storage`` / ``torch.storage.UntypedStorage``: the numpy code of its bytes."""

    __slots__ = ()


class Storage(NamedTuple):
    """One storage of a torch archive: its bytes, read once however many tensors share them."""

    data: bytes
    code: str


def element_dtype(code: str, big_endian: bool) -> np.dtype[Any]:
    dtype = np.dtype("<u2" if code == BFLOAT16 else code)
    return dtype.newbyteorder(">") if big_endian and dtype.itemsize > 1 else dtype


def widened(element: np.dtype[Any], code: str) -> int:
    """The itemsize of the array an element of ``code`` is returned as (bfloat16 becomes float32)."""
    return 4 if code == BFLOAT16 else element.itemsize


def widen_bfloat16(array: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """bfloat16 bits (``uint16``) as the float32 values they are, typed ``BFloat16Array``."""
    return (array.astype(np.uint32) << 16).view(np.float32).view(BFloat16Array)


def torch_device(source: str, *args: Any) -> str:
    """``torch.device(...)`` as a plain string: where the tensor lived when it was saved (a refusal
    names ``source``, the file)."""
    if not (1 <= len(args) <= 2 and all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args)):
        got = ", ".join(brief(a) for a in args[:2]) if args else "nothing"
        raise LayoutError(f"{source}: torch.device of {got}; expected a device type and an index")
    return ":".join(str(a)[:64] for a in args)


def view_bytes(buffer: Any, dtype: Any, shape: Any, source: str, field: str) -> npt.NDArray[Any]:
    """The ``dtype`` (a torch dtype name, ``"torch.int16"`` or ``"int16"``) array of ``shape`` held
    in the bytes ``buffer`` (bytes or a uint8 array), as frameworks serialize tensors by hand."""
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in TORCH_DTYPES:
        raise LayoutError(
            f"{source}: field {field!r} has dtype {brief(dtype)}; expected a numeric torch dtype"
        )
    if isinstance(buffer, (bytes, bytearray)):
        raw = np.frombuffer(buffer, dtype=np.uint8)
    elif isinstance(buffer, np.ndarray):
        raw = buffer
    else:
        raise LayoutError(f"{source}: field {field!r} holds {brief(buffer)}; expected flat bytes")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise LayoutError(f"{source}: field {field!r} holds {brief(raw)}; expected flat bytes")
    code = TORCH_DTYPES[name]
    element = element_dtype(code, big_endian=False)
    shape = tuple(shape) if isinstance(shape, list) else shape
    shape = shape_of(shape, f"{source}: field {field!r}", widened(element, code))
    nbytes = math.prod(shape) * element.itemsize
    if raw.size < nbytes:
        raise LayoutError(
            f"{source}: field {field!r} holds {raw.size} bytes; "
            f"expected {nbytes} for {name} {list(shape)[:8]}"
        )
    array = np.frombuffer(raw[:nbytes].tobytes(), dtype=element).reshape(shape)
    return widen_bfloat16(array) if code == BFLOAT16 else array


_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


class TorchArchive:
    """A ``torch.save`` zip archive: its records read only when stored, unencrypted, inside the file
    and CRC-correct; every zipfile failure one ``LayoutError`` naming the record."""

    def __init__(self, file: Any, size: int, source: str) -> None:
        self.file, self.size, self.source = file, size, source
        try:
            self.zip = zipfile.ZipFile(file)
            names = self.zip.namelist()
        except Exception as err:  # BadZipFile, and whatever a damaged directory makes zipfile raise
            raise LayoutError(
                f"{source}: not a torch.save archive ({type(err).__name__}: {first_line(err)}: truncated, "
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
                f"{where}: record {name} unreadable ({type(err).__name__}: {first_line(err)}); "
                "expected an intact torch.save archive"
            ) from None
