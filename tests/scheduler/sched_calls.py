"""Functions plan files in the tests ``call:`` (``call: "sched_calls:summarise"``)."""

from __future__ import annotations

from typing import Any


def summarise(ni: Any, indent: int = 0) -> dict[str, Any]:
    return {"node": ni.id, "attempt": ni.attempt, "inputs": list(ni.inputs), "indent": indent}


def peek(ni: Any, path: str) -> dict[str, Any]:
    """Reads ``path`` as a flow author would (a plain open relative to the working directory) and writes
    ``out/peeked.txt`` by an absolute path under the workspace."""
    import os

    with open(path) as f:
        text = f.read()
    os.makedirs("out", exist_ok=True)
    with open(os.path.join(os.getcwd(), "out", "peeked.txt"), "w") as f:
        f.write(text.upper())
    return {"cwd_is_root": os.getcwd() == str(ni.root), "text": text}
