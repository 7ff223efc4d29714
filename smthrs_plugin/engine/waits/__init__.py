"""Durable waits as flow code calls them (``sp.sleep``, ``sp.wait_for``, ``sp.complete``) and the in-process wake bus.

Invariant: a wait's record lives in the waits owner (``records._waits``); this package only decides when the
caller may return: a sleep never returns before its stored deadline, and a waiter subscribes to the wake bus
before it reads the store, so no completion is lost between the two. Nothing is re-exported here: the run
context (``engine._context``) needs the wake bus before the flow waits can be imported.
"""
