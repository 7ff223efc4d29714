"""An example smthrs plugin, discovered through its ``smthrs`` entry point — no change to smthrs or to your code.

- a plan action: ``call: shout`` in a plan file (``with: {text: ..., out: ...}``) writes the text, upper-cased,
  into the node's sandbox;
- an observer: every settled node (plan nodes and ``@step`` calls) is appended as one JSON line to the file named
  by ``SMTHRS_EXAMPLE_LOG`` (default ``smthrs-example-plugin.jsonl`` in the current directory);
- a value codec (``smthrs_value_codecs``): :class:`Money` values can be ``@step`` arguments (keyed by amount and
  currency) and cached step results (stored as ``{"amount": "12.50", "currency": "EUR"}``, tag
  ``example.Money``). Its ``decode`` only builds a ``Money``: it never imports or runs anything the stored
  document names.
"""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path
from typing import Any

from smthrs_plugin.hooks import hookimpl


def shout(node_input: Any, text: str = "", out: str = "shout.txt") -> dict:
    """``call: shout`` — the action runs in the node's sandbox; declare ``out`` in the node's ``writes``."""
    loud = text.upper() + "!"
    (Path(node_input.root) / out).write_text(loud + "\n")
    return {"chars": len(loud)}


@hookimpl
def smthrs_plan_actions() -> dict:
    return {"shout": shout}


@hookimpl
def smthrs_node_settled(run_id: str, plan_id: str | None, settlement: Any) -> None:
    line = {
        "run_id": run_id,
        "plan_id": plan_id,
        "node": settlement.node,
        "outcome": settlement.outcome,
        "cache_decision": settlement.cache_decision,
    }
    with open(os.environ.get("SMTHRS_EXAMPLE_LOG", "smthrs-example-plugin.jsonl"), "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


class Money:
    """An amount in a currency (a plain class: only this plugin's codec knows how to key and store it)."""

    __slots__ = ("amount", "currency")

    def __init__(self, amount: Decimal | str, currency: str) -> None:
        self.amount = Decimal(amount)
        self.currency = currency

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and (self.amount, self.currency) == (other.amount, other.currency)

    def __hash__(self) -> int:
        return hash((self.amount, self.currency))

    def __repr__(self) -> str:
        return f"Money({str(self.amount)!r}, {self.currency!r})"


class MoneyCodec:
    """The ``example.Money`` codec (see ``smthrs_plugin.codecs.ValueCodec``)."""

    tag = "example.Money"

    def handles(self, value: Any) -> bool:
        return type(value) is Money

    def key_form(self, value: Any, registry: Any) -> dict:
        return {"amount": str(value.amount), "currency": value.currency}

    def encode(self, value: Any, registry: Any, sink: Any) -> dict:
        return self.key_form(value, registry)

    def decode(self, doc: Any, registry: Any, source: Any) -> Money:
        from smthrs_plugin.errors import CodecError

        if not isinstance(doc, dict) or set(doc) != {"amount", "currency"}:
            raise CodecError("undecodable", f"a stored Money must be {{amount, currency}}, got {doc!r}")
        return Money(str(doc["amount"]), str(doc["currency"]))

    def blob_digests(self, doc: Any) -> list:
        return []


@hookimpl
def smthrs_value_codecs(settings: Any) -> list:
    return [MoneyCodec()]
