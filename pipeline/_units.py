"""The scalar field types of specs: sizes, durations, counts and checked string shapes.

:data:`ByteSize` and :data:`Duration` accept a plain non-negative number (bytes, seconds)
or a string with a unit as a person writes it in YAML (``64KiB``, ``30s``, ``500ms``).
They always store the plain number, so a validated spec dumps to JSON as ints and floats
and loads back unchanged. The string types (:data:`StageName`, :data:`ImportPath`, ...)
check only a value's shape: the runtime imports classes and opens devices, and reports
its own errors when that fails.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

__all__ = (
    "BUILTIN_TRANSPORTS",
    "MAX_REPLICAS",
    "BindAddress",
    "ByteSize",
    "Count",
    "Device",
    "Duration",
    "ImportPath",
    "Replicas",
    "StageName",
    "Timeout",
    "TransportKind",
    "parse_byte_size",
    "parse_duration",
)

#: Multipliers per size unit. ``KB`` is 1000 and ``KiB`` is 1024, as in IEC 80000-13;
#: spelling both out avoids guessing which one a user meant by a bare ``K``.
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}

#: Seconds per duration unit.
_DURATION_UNITS: dict[str, Decimal] = {
    "": Decimal(1),
    "s": Decimal(1),
    "ms": Decimal("0.001"),
    "us": Decimal("0.000001"),
    "µs": Decimal("0.000001"),
    "ns": Decimal("0.000000001"),
    "m": Decimal(60),
    "h": Decimal(3600),
}

# A decimal number, optional blanks, then a unit from a closed list. Signs and exponents
# are not allowed: a negative size or duration is never meant, and "1e3s" is unreadable.
_NUMBER = r"(?P<number>\d+(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"{_NUMBER}\s*(?P<unit>{'|'.join(u for u in _SIZE_UNITS if u)})?")
_DURATION_RE = re.compile(rf"{_NUMBER}\s*(?P<unit>{'|'.join(u for u in _DURATION_UNITS if u)})?")

_SIZE_HINT = "a byte count like 512, 64KiB, 1.5MiB, 1GiB or 64KB"
_DURATION_HINT = "a duration like 30, 1.5s, 500ms, 250us, 2m or 1h"


#: The largest byte size a spec may name (1 EiB): beyond any real memory, and small enough
#: for every message that carries it.
MAX_BYTE_SIZE = 1 << 60


def format_size(n: int) -> str:
    """``n`` bytes for people: ``"4 MiB (4194304 bytes)"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit} ({n} bytes)"
    return f"{n} bytes"


def _capped(size: int, value: object) -> int:
    if size > MAX_BYTE_SIZE:
        raise PydanticCustomError(
            "invalid_byte_size",
            "size {value} is larger than 1 EiB, more than any host holds",
            {"value": repr(value)},
        )
    return size


def parse_byte_size(value: object) -> int:
    """Return the number of bytes ``value`` stands for.

    Args:
        value: a non-negative int (or integral float), or a string such as ``"64KiB"``.

    Returns:
        The size in bytes.

    Raises:
        PydanticCustomError: ``value`` is negative, fractional, or not a size.
    """
    # bool is an int subclass, but ``inline_threshold: yes`` is a mistake, not one byte.
    if isinstance(value, bool):
        raise _invalid("byte size", value, _SIZE_HINT)
    if isinstance(value, int):
        if value < 0:
            raise _invalid("byte size", value, _SIZE_HINT)
        return _capped(value, value)
    if isinstance(value, float):
        if not value.is_integer() or value < 0:
            raise _invalid("byte size", value, _SIZE_HINT)
        return _capped(int(value), value)
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value.strip())
        if match is not None:
            # Decimal keeps "1.5MiB" exact; a float would round some fractional sizes.
            size = Decimal(match["number"]) * _SIZE_UNITS[match["unit"] or ""]
            if size == size.to_integral_value():
                return _capped(int(size), value)
            raise PydanticCustomError(
                "invalid_byte_size",
                "size {value} is not a whole number of bytes",
                {"value": repr(value)},
            )
    raise _invalid("byte size", value, _SIZE_HINT)


def parse_duration(value: object) -> float:
    """Return the number of seconds ``value`` stands for.

    Args:
        value: a non-negative finite number of seconds, or a string such as ``"500ms"``.

    Returns:
        The duration in seconds.

    Raises:
        PydanticCustomError: ``value`` is negative, not finite, or not a duration.
    """
    if isinstance(value, bool):
        raise _invalid("duration", value, _DURATION_HINT)
    seconds: float | None = None
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    elif isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip())
        if match is not None:
            seconds = float(Decimal(match["number"]) * _DURATION_UNITS[match["unit"] or ""])
    # Non-finite durations (also from numbers too large for a float) are refused here:
    # every process that reads the spec must agree on it.
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise _invalid("duration", value, _DURATION_HINT)
    return seconds


def _invalid(noun: str, value: object, hint: str) -> PydanticCustomError:
    """Build the error for a value that is not a ``noun`` at all."""
    # The template engine only substitutes names, so the repr is made here. Types
    # starting with "invalid_" quote the value themselves; see _yaml._describe.
    shown = repr(value)
    if len(shown) > 60:  # a one-line error, even for a 400-digit number
        shown = shown[:40] + "..." + shown[-8:]
    return PydanticCustomError(
        "invalid_" + noun.replace(" ", "_"),
        "invalid {noun} {value}: expected {hint}",
        {"noun": noun, "value": shown, "hint": hint},
    )


def _schema(pattern: re.Pattern[str], number: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a unit type: a plain number or a string with a unit."""
    # JSON Schema patterns are ECMA-262 regexes, which spell named groups differently.
    plain = re.sub(r"\(\?P<\w+>", "(?:", pattern.pattern)
    return {"anyOf": [number, {"type": "string", "pattern": f"^{plain}$"}]}


#: A size in bytes: an int >= 0, or a string such as ``"64KiB"``, ``"1.5MiB"``, ``"64KB"``.
ByteSize = Annotated[
    int,
    BeforeValidator(parse_byte_size),
    WithJsonSchema(_schema(_SIZE_RE, {"type": "integer", "minimum": 0})),
]

#: A size in bytes of at least one byte.
PositiveByteSize = Annotated[ByteSize, Field(ge=1)]

#: A duration in seconds: a number >= 0, or a string such as ``"30s"``, ``"500ms"``, ``"2m"``.
Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema(_schema(_DURATION_RE, {"type": "number", "minimum": 0})),
]

#: The transports stagewire ships; any other kind is an entry point or an import path.
BUILTIN_TRANSPORTS = ("inline", "shm", "cuda_ipc", "network", "auto")

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH = rf"{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*"
_PORT = r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|\d{1,4})"


def _shaped(noun: str, pattern: str, expected: str) -> AfterValidator:
    """A validator refusing strings that do not fully match ``pattern``."""
    regex = re.compile(pattern)
    kind = "invalid_" + noun.replace(" ", "_")

    def check(value: str) -> str:
        if regex.fullmatch(value):
            return value
        raise PydanticCustomError(
            kind,
            "invalid {noun} {value}: expected {expected}",
            {"noun": noun, "value": repr(value), "expected": expected},
        )

    return AfterValidator(check)


#: A stage's name. Hyphens are allowed for readability ("pre-process"); "@" is kept for
#: pseudo-stages such as the client, so a user stage can never collide with one. At most
#: 100 characters: it is part of each worker's socket identity, which ZeroMQ caps.
StageName = Annotated[
    str,
    _shaped(
        "stage name",
        r"[A-Za-z_][A-Za-z0-9_-]{0,99}",
        "letters, digits, '_' and '-', starting with a letter or '_', at most 100 of them",
    ),
]
#: Where a class lives, as ``package.module:Class``.
ImportPath = Annotated[str, _shaped("import path", _IMPORT_PATH, "'package.module:Class'")]
#: Where a stage runs: ``cpu``, ``cuda`` or ``cuda:N``.
Device = Annotated[str, _shaped("device", r"cpu|cuda(?::\d+)?", "cpu, cuda or cuda:N")]
#: A ZeroMQ endpoint to bind: ``tcp://HOST:PORT`` or ``ipc://PATH``. Not ``ipc://*``:
#: ZeroMQ would make a directory for it that nothing removes.
BindAddress = Annotated[
    str,
    _shaped(
        "bind address",
        rf"tcp://(?:\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):{_PORT}|ipc://(?!\*$).+",
        "tcp://HOST:PORT or ipc://PATH (a path: for ipc://* ZeroMQ makes a directory that "
        "nothing removes)",
    ),
]
#: A transport: a built-in kind, an entry-point name, or ``package.module:Class``.
TransportKind = Annotated[
    str,
    _shaped(
        "transport",
        rf"{_IDENT}|{_IMPORT_PATH}",
        f"one of {', '.join(BUILTIN_TRANSPORTS)}, an entry-point name, "
        "or an import path 'package.module:Class'",
    ),
]

#: A count of at least one. It is strict so that ``replicas: "2"`` and ``replicas: true``
#: are refused rather than coerced; at most 2**31 - 1, which every message can carry.
Count = Annotated[int, Field(strict=True, ge=1, le=2**31 - 1)]
#: The most replicas of one stage: each is a process (with its sockets and, on shm edges,
#: its segments), and the master keeps a slot for each from the start, so a count past
#: this is a typo, which would otherwise exhaust the host before its first request.
MAX_REPLICAS = 1024
#: A stage's replica count: strict, at least one, at most :data:`MAX_REPLICAS`.
Replicas = Annotated[int, Field(strict=True, ge=1, le=MAX_REPLICAS)]
#: A duration that must be positive: a zero timeout would fail everything at once.
Timeout = Annotated[Duration, Field(gt=0)]
