"""Durable records, one owner per kind: the floor between the table definitions (``stores``) and the engine.

Invariant: each kind of durable record (runs, journal entries, attempts, waits, the run DAG, the cache index,
control records) has ONE module here that holds all of its SQL and is the only decoder of its rows; everything
above calls these owners and never imports a table. Owners expose ``*_in(conn, ...)`` functions so a caller still
composes one transaction (a fenced run update and its journal record commit together), and small frozen result
types. Nothing here imports ``engine`` or anything above it.
"""

from .attempts import AttemptStore
from .journal import Journal
from .runs import RunStore
from .waits import WaitStore

__all__ = ["AttemptStore", "Journal", "RunStore", "WaitStore"]
