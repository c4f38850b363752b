"""The checksummed record codec: a `Record` (JSON-able meta plus named arrays) as one
self-describing blob.

Blob layout (all integers little-endian)::

    0   8 B   magic  b"\\x89CEDLMKV"
    8   4 B   format version (uint32) = 1
    12  8 B   header length H (uint64)
    20  H B   header: UTF-8 JSON {"key", "meta", "arrays": [{name, dtype, shape, offset, nbytes}],
                                  "data_nbytes"}
    ..        zero padding to a multiple of 64  -> data_start
    ..        array bytes; array i at data_start + offset_i (offsets 64-aligned), zero padding between
    -32 32 B  blake2b(digest_size=32) of every byte before it

Decoding checks magic, version, every length and offset, and the checksum before any array is
built; any mismatch raises :class:`CorruptRecord`. Arrays come back as numpy arrays whose bytes are
exactly the bytes that were put (no dtype or value conversion).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator

import numpy as np

MAGIC = b"\x89CEDLMKV"
VERSION = 1
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_ALIGN = 64
_CHECKSUM_SIZE = 32
_MAX_HEADER = 64 << 20  # a header larger than this is corruption, not a record
_CHUNK = 8 << 20  # write granularity (bounded copies for huge arrays)

# The dtypes a record may carry (little-endian on disk). The engine uses uint8 (KV / index-key
# bytes), int32 (token ids) and float32 (compressor state); the others are allowed for convenience.
_DTYPES = {
    "uint8": np.dtype("<u1"),
    "int8": np.dtype("<i1"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
}


class CorruptRecord(ValueError):
    """A blob failed validation (bad magic/version/lengths/checksum). Stores treat it as a miss."""


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if type(value).__module__.split(".")[0] == "torch":
        import torch

        if value.dtype not in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.float32):
            raise TypeError(f"array {name!r}: unsupported torch dtype {value.dtype} (allowed: {sorted(_DTYPES)})")
        value = value.detach().to("cpu").contiguous().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"array {name!r}: expected a numpy array or torch tensor, got {type(value).__name__}")
    if value.dtype.name not in _DTYPES:
        raise TypeError(f"array {name!r}: unsupported dtype {value.dtype} (allowed: {sorted(_DTYPES)})")
    # Byte-order conversion only (values unchanged); a no-op for native little-endian arrays.
    return np.ascontiguousarray(value, dtype=_DTYPES[value.dtype.name])


@dataclass
class Record:
    """One cache entry: JSON-able ``meta`` plus named arrays (uint8 KV rows, int32 token ids, fp32
    compressor state...). Arrays may be numpy arrays or torch tensors on put; get returns numpy."""

    meta: dict = field(default_factory=dict)
    arrays: dict = field(default_factory=dict)

    def tensors(self) -> dict:
        """The arrays as CPU torch tensors (zero-copy views of the decoded arrays)."""
        import torch

        return {k: torch.from_numpy(_as_numpy(k, v)) for k, v in self.arrays.items()}

    @property
    def nbytes(self) -> int:
        return sum(_as_numpy(k, v).nbytes for k, v in self.arrays.items())


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Encoded:
    """A record laid out as a blob: header bytes + array buffers, written without a full copy.

    ``size`` is the blob's length; ``parts()`` yields its bytes in order, ``tobytes()`` joins them."""

    def __init__(self, record: Record, key: str | None):
        if not isinstance(record, Record):
            raise TypeError(f"expected a Record, got {type(record).__name__}")
        if not isinstance(record.meta, dict):
            raise TypeError(f"Record.meta must be a dict, got {type(record.meta).__name__}")
        if not isinstance(record.arrays, dict):
            raise TypeError(f"Record.arrays must be a dict, got {type(record.arrays).__name__}")
        self.arrays: list[np.ndarray] = []
        descs = []
        offset = 0
        for name, value in record.arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"array names must be str, got {name!r}")
            a = _as_numpy(name, value)
            offset = _align(offset)
            descs.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape),
                          "offset": offset, "nbytes": int(a.nbytes)})
            self.arrays.append(a)
            offset += a.nbytes
        header = {"key": key, "meta": record.meta, "arrays": descs, "data_nbytes": offset}
        try:
            self.header = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise TypeError(f"Record.meta must be JSON-serialisable (no NaN/inf): {e}") from None
        self.prefix = _PREFIX.pack(MAGIC, VERSION, len(self.header))
        self.data_start = _align(len(self.prefix) + len(self.header))
        self.descs = descs
        self.size = self.data_start + offset + _CHECKSUM_SIZE

    def parts(self) -> Iterator[memoryview | bytes]:
        """The blob's bytes, in order, checksum last."""
        h = hashlib.blake2b(digest_size=_CHECKSUM_SIZE)
        head = self.prefix + self.header + bytes(self.data_start - len(self.prefix) - len(self.header))
        h.update(head)
        yield head
        pos = 0
        for d, a in zip(self.descs, self.arrays):
            if d["offset"] > pos:
                pad = bytes(d["offset"] - pos)
                h.update(pad)
                yield pad
            mv = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
            for i in range(0, len(mv), _CHUNK):
                chunk = mv[i:i + _CHUNK]
                h.update(chunk)
                yield chunk
            pos = d["offset"] + d["nbytes"]
        yield h.digest()

    def tobytes(self) -> bytes:
        out = bytearray(self.size)
        pos = 0
        for p in self.parts():
            out[pos:pos + len(p)] = p
            pos += len(p)
        assert pos == self.size
        return bytes(out)


def encode_record(record: Record, key: str | None = None) -> bytes:
    """Serialise ``record`` to one self-describing blob (see the module docstring)."""
    return Encoded(record, key).tobytes()


def _header_length(buf) -> int:
    """Validate the fixed prefix; return the header length."""
    if len(buf) < _PREFIX.size:
        raise CorruptRecord(f"blob too short ({len(buf)} bytes)")
    magic, version, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptRecord("bad magic")
    if version != VERSION:
        raise CorruptRecord(f"unsupported format version {version} (expected {VERSION})")
    if hlen > _MAX_HEADER:
        raise CorruptRecord(f"header length {hlen} is implausible")
    return hlen


def _parse_header(raw) -> dict:
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptRecord(f"bad header JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("meta"), dict) \
            or not isinstance(header.get("arrays"), list) or not isinstance(header.get("data_nbytes"), int):
        raise CorruptRecord("header is missing meta/arrays/data_nbytes")
    return header


def read_header(f: BinaryIO) -> dict:
    """The header of the blob an open binary file starts with (reads the prefix and header only,
    no checksum). Raises :class:`CorruptRecord`."""
    hlen = _header_length(f.read(_PREFIX.size))
    return _parse_header(f.read(hlen))


def decode_record(blob, expect_key: str | None = None) -> tuple[Record, str | None]:
    """Parse and fully validate a blob; return (record, stored key). Raises :class:`CorruptRecord`.

    ``blob`` may be bytes, bytearray or memoryview; a writable buffer (bytearray) gives writable
    arrays that share its memory, otherwise the arrays are read-only views.
    """
    try:
        mv = memoryview(blob).cast("B")
        hlen = _header_length(mv)
        hend = _PREFIX.size + hlen
        if len(mv) < hend + _CHECKSUM_SIZE:
            raise CorruptRecord("blob truncated inside header")
        header = _parse_header(mv[_PREFIX.size:hend])
        data_start = _align(hend)
        data_nbytes = header["data_nbytes"]
        if data_nbytes < 0 or len(mv) != data_start + data_nbytes + _CHECKSUM_SIZE:
            raise CorruptRecord(f"blob length {len(mv)} != {data_start + data_nbytes + _CHECKSUM_SIZE} "
                                "(truncated or extended)")
        body_end = len(mv) - _CHECKSUM_SIZE
        if hashlib.blake2b(mv[:body_end], digest_size=_CHECKSUM_SIZE).digest() != bytes(mv[body_end:]):
            raise CorruptRecord("checksum mismatch")
        key = header.get("key")
        if expect_key is not None and key != expect_key:
            raise CorruptRecord(f"blob holds key {key!r}, expected {expect_key!r}")
        arrays = {}
        for d in header["arrays"]:
            name, dtype, shape = d["name"], _DTYPES.get(d["dtype"]), tuple(d["shape"])
            off, nb = d["offset"], d["nbytes"]
            if not isinstance(name, str) or dtype is None or name in arrays \
                    or not all(isinstance(s, int) and s >= 0 for s in shape) \
                    or not isinstance(off, int) or not isinstance(nb, int) or off < 0 \
                    or nb != math.prod(shape) * dtype.itemsize or off + nb > data_nbytes:
                raise CorruptRecord(f"bad array descriptor {d!r}")
            count = nb // dtype.itemsize
            arrays[name] = np.frombuffer(mv, dtype=dtype, count=count, offset=data_start + off).reshape(shape)
        return Record(meta=header["meta"], arrays=arrays), key
    except CorruptRecord:
        raise
    except Exception as e:  # any structural surprise is corruption, never a crash in the caller
        raise CorruptRecord(f"malformed blob: {type(e).__name__}: {e}") from None
