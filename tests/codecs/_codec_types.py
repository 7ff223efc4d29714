"""Module-level types for the codec tests (importable by spawned processes: a class path must name a module)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from decimal import Decimal
from typing import Any

import pydantic


class Point(pydantic.BaseModel):
    x: int
    y: float
    tags: list[str] = []


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class Order:
    id: int
    when: dt.datetime
    point: Point
    payload: bytes
    pair: tuple[int, str]


def samples() -> dict[str, Any]:
    """One value per built-in codec (plus a nested dataclass), deterministic."""
    utc = dt.timezone.utc
    return {
        "pydantic": Point(x=1, y=2.5, tags=["a"]),
        "dataclass": Order(
            7, dt.datetime(2024, 5, 1, 12, 0, tzinfo=utc), Point(x=2, y=0.5), b"\x00\x01", (1, "a")
        ),
        "datetime": dt.datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        "date": dt.date(2024, 2, 29),
        "time": dt.time(8, 15, tzinfo=utc),
        "decimal": Decimal("12.50"),
        "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "enum": Color.BLUE,
        "tuple": (1, "two", 3.0, None),
        "bytes": b"hello world",
    }
