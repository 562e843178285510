"""How a process function's per-key values are stored as bytes (migration and checkpoints).

Plain values (None, booleans, integers, floats, strings, bytes, lists, tuples and dicts of
them) are written as msgpack, which decodes without running code. Anything else is pickled,
which only a job with a secret may do: its state bytes are authenticated
(`keyshift.runtime.state_integrity`) before they are decoded, so a pickle is only ever loaded
from this job's own processes. Used by `keyshift.runtime.state.ProcessState`.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack

PLAIN = b"m"
PICKLED = b"p"
_TUPLE = 1  # msgpack extension type code: a tuple comes back as a tuple, not a list


class StateValueError(TypeError):
    """A state value that this job cannot store or read safely."""


def _to_plain(value: Any) -> msgpack.ExtType:
    if type(value) is tuple:
        return msgpack.ExtType(_TUPLE, _packb(list(value)))
    raise TypeError(f"not plain data: {type(value).__name__}")


def _from_plain(code: int, data: bytes) -> Any:
    if code == _TUPLE:
        return tuple(msgpack.unpackb(data, ext_hook=_from_plain, strict_map_key=False))
    raise StateValueError(f"unknown msgpack extension {code} in a state value")


def _packb(value: Any) -> bytes:
    # strict_types: subclasses (named tuples, enums, user dicts) are not silently flattened.
    packed: bytes = msgpack.packb(value, strict_types=True, default=_to_plain, use_bin_type=True)
    return packed


class ValueCodec:
    """Encodes and decodes state values; pickle only when the job's state is authenticated."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle

    def encode(self, value: Any) -> bytes:
        try:
            return PLAIN + _packb(value)
        except (TypeError, ValueError, OverflowError) as exc:
            if not self.allow_pickle:
                raise StateValueError(
                    f"state value of type {type(value).__name__} is not plain data ({exc}); "
                    "only a job with a secret (KEYSHIFT_JOB_SECRET) may keep such values, "
                    "because their bytes must be authenticated before they are unpickled"
                ) from exc
            return PICKLED + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def check(self, blobs: list[bytes]) -> None:
        """Refuse encoded values this codec would refuse to decode, before they are stored."""
        if not self.allow_pickle and any(blob[:1] == PICKLED for blob in blobs):
            raise StateValueError(
                "refusing a pickled state value: this job has no secret to authenticate it"
            )

    def decode(self, blob: bytes) -> Any:
        kind, body = blob[:1], blob[1:]
        if kind == PLAIN:
            return msgpack.unpackb(body, ext_hook=_from_plain, strict_map_key=False, raw=False)
        if kind == PICKLED:
            if not self.allow_pickle:
                raise StateValueError(
                    "refusing a pickled state value: this job has no secret to authenticate it"
                )
            return pickle.loads(body)
        raise StateValueError(f"state value with unknown encoding {kind!r}")
