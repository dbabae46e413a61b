"""Tensors as the Open Inference Protocol carries them, for HTTP (:mod:`.oip`) and gRPC
(:mod:`.grpc_server`) alike: one place decides what a datatype is, how its bytes read, and what a
request gets told when they are wrong.

Every numeric datatype goes in and out: BOOL, INT8-64, UINT8-64, FP16, FP32, FP64 and BF16, as
raw little-endian bytes (HTTP's binary tensor extension, gRPC's ``raw_input_contents``) or as
values (JSON ``data``, gRPC's typed ``contents``). BF16 reads through ``ml_dtypes`` (a jax
dependency, so already installed). BYTES is refused: a model's inputs are device arrays, and a
string has no device layout; the refusal says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .spec import OIP_DATATYPES, InferError

# OIP datatype -> numpy dtype name (the inverse of OIP_DATATYPES).
NUMPY_OF = {v: k for k, v in OIP_DATATYPES.items()}
BYTES_REFUSAL = ("BYTES tensors are not accepted: an xshare model takes numeric tensors (BOOL, INT8-64, "
                 "UINT8-64, FP16, BF16, FP32, FP64); encode strings to numbers before sending them")


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of an OIP datatype (BF16: ml_dtypes' bfloat16)."""
    if datatype == "BF16":
        import ml_dtypes  # jax's own dependency: no new install

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(NUMPY_OF[datatype])


def datatype_of(dtype: Any) -> str:
    """The OIP datatype of a numpy dtype (``float32`` -> ``FP32``)."""
    name = str(np.dtype(dtype))
    return OIP_DATATYPES.get(name, name.upper())


def check_header(meta: dict[str, Any], name: Any, datatype: Any, shape: Any, seen: set) -> np.dtype:
    """One input's name, datatype and shape against the model's metadata; its numpy dtype.
    ``InferError(400)`` names what is wrong and what the model takes."""
    declared = {i["name"]: i for i in meta["inputs"]}
    if not isinstance(name, str) or name not in declared:  # (a JSON list or object is no name: unhashable)
        raise InferError(400, f"unknown input {name!r}; model {meta['name']!r} takes {sorted(declared)}")
    if name in seen:
        raise InferError(400, f"input {name!r} is given twice")
    seen.add(name)
    want = declared[name]["datatype"]
    if datatype == "BYTES":
        raise InferError(400, f"input {name!r}: {BYTES_REFUSAL}; model {meta['name']!r} takes {want}")
    if datatype != want:
        raise InferError(400, f"input {name!r} has datatype {datatype!r}; model {meta['name']!r} takes {want}")
    if (not isinstance(shape, (list, tuple))
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise InferError(400, f"input {name!r} has shape {shape!r}; give a list of ints >= 0")
    return numpy_dtype(want)


def from_bytes(name: str, datatype: str, dtype: np.dtype, shape: list[int], raw: Any,
               what: str = "binary data") -> np.ndarray:
    """A tensor from its raw little-endian bytes (a copy-free view when the buffer allows)."""
    count = int(np.prod(shape)) if shape else 1
    need = count * dtype.itemsize
    if len(raw) != need:
        raise InferError(400, f"input {name!r}: {len(raw)} bytes of {what}; shape {list(shape)} of {datatype} "
                              f"needs {need} bytes")
    return np.frombuffer(raw, dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype, count).reshape(shape)


def from_values(name: str, datatype: str, dtype: np.dtype, shape: list[int], values: Any) -> np.ndarray:
    """A tensor from a (possibly nested) list of values, checked to be exactly representable:
    numpy would wrap 300 into an INT8 or cut 1.5 to an INT32 without a word."""
    count = int(np.prod(shape)) if shape else 1
    try:
        raw = np.asarray(values)
    except (ValueError, TypeError, OverflowError):  # ragged lists, or ints numpy cannot hold: look closer
        raw = None
    # Vectorised where numpy read the values exactly: integers as integers, or floats (all of a
    # float target's values, or whole numbers below 2**53, which float64 holds exactly).
    if raw is not None and raw.dtype.kind in "biuf" and raw.size == count and (
            dtype.kind not in "iu" or raw.dtype.kind != "f" or not raw.size or np.abs(raw).max() < 2.0**53):
        flat = raw.ravel()
    else:
        try:
            # As Python objects: numpy reads [0, 2**64 - 1, 7] as float64 and loses bits.
            flat = np.asarray(values, dtype=object).ravel()
        except (ValueError, TypeError) as err:  # ragged lists
            raise InferError(400, f"input {name!r}: its data are not {datatype} values: {err}") from None
        numbers = (bool, int, float, np.bool_, np.integer, np.floating)
        bad = next((v for v in flat if not isinstance(v, numbers)), None)
        if bad is not None:
            raise InferError(400, f"input {name!r}: its data are not {datatype} values (got {bad!r:.40})")
    if flat.size != count:
        raise InferError(400, f"input {name!r} has {flat.size} values; shape {list(shape)} needs {count}")
    if dtype.kind in "iu" and flat.size:
        if flat.dtype == object:
            if any(isinstance(v, (float, np.floating)) and not float(v).is_integer() for v in flat):
                raise InferError(400, f"input {name!r}: {datatype} takes whole numbers; its data hold fractions")
            ints = [int(v) for v in flat]
            low, high = min(ints), max(ints)
            exact: np.ndarray | list[int] = ints
        else:
            if flat.dtype.kind == "f" and not np.array_equal(flat, np.trunc(flat)):
                raise InferError(400, f"input {name!r}: {datatype} takes whole numbers; its data hold fractions")
            low, high = flat.min(), flat.max()
            exact = flat
        info = np.iinfo(dtype)
        if low < info.min or high > info.max:
            raise InferError(400, f"input {name!r}: a value is outside {datatype}'s range {info.min}..{info.max}")
        arr = np.array(exact, dtype=dtype)
    elif flat.dtype == object:
        arr = np.array([bool(v) if dtype.kind == "b" else float(v) for v in flat], dtype=dtype)
    else:
        arr = flat.astype(dtype)
    return arr.reshape(shape)


def to_values(arr: np.ndarray) -> list:
    """A tensor's values, flat, for JSON: every numeric type reads back exactly (Python floats
    hold FP16, BF16 and FP32 values exactly and JSON writes their shortest round-trip form)."""
    if arr.dtype.kind == "V" or str(arr.dtype) == "bfloat16":
        return arr.astype(np.float32).ravel().tolist()
    return arr.ravel().tolist()


def to_bytes(arr: np.ndarray) -> bytes:
    """A tensor's raw little-endian bytes, row-major."""
    a = np.ascontiguousarray(arr)
    if a.dtype.itemsize > 1 and a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes()


__all__ = ["numpy_dtype", "datatype_of", "check_header", "from_bytes", "from_values", "to_values", "to_bytes",
           "BYTES_REFUSAL", "NUMPY_OF"]
