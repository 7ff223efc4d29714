"""The engine: what runs DO over their durable records — ownership (claim, heartbeat, steal on evidence), the
run lease every path that runs a run holds (``lease``: claim, heartbeat, self-interrupt, conclude once),
driving (activate, run, end in one durable transition; sweeps), durable waits as flow code calls them, the run
context, cancellation through the run DAG, lifecycle facts and disaster recovery.

Invariant: the engine holds no SQL. Every row it reads or writes goes through its owner in ``records`` (runs,
journal, attempts, waits, run DAG), so a transition and the records it journals compose in ONE transaction the
owner defines. Concepts are packages (``ownership``, ``drive``, ``waits``) or modules (``context``,
``cancellation``, ``facts``, ``recovery``).
"""
