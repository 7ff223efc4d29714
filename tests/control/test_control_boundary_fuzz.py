"""The identity boundary THROUGH the durable control plane (SQLite): generated hostile inputs to ``Control.plan`` and
idempotency keys to ``Control.run`` answer a card/receipt or a typed ``InvalidInput`` — never another exception,
and never a write on refusal. (``tests/control/test_control_identity.py`` fuzzes ``decode_input`` itself with 2,000
inputs against an independent oracle; this pins that the facade crosses that boundary before writing anything.)"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from _control_support import count, release_plan
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from smthrs_plugin.canonical import canonical_bytes
from smthrs_plugin.control.facade import Control
from smthrs_plugin.control.receipts import Accepted, AlreadyApplied
from smthrs_plugin.errors import InvalidInput
from smthrs_plugin.settings import load_settings
from smthrs_plugin.stores.database import Database, open_database

hostile_text = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=())
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**60), max_value=2**60),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
    st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner),
        st.dictionaries(st.one_of(hostile_text, st.integers(0, 3)), inner, max_size=4),
    ),
    max_leaves=20,
)


def _deep(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = {"d": v}
    return v


hostile = st.one_of(
    values,
    st.integers(120, 140).map(_deep),
    st.sampled_from([list(range(100_001)), "x" * (4 * 1024 * 1024 + 1), [math.nan]]),
)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Control, Database]]:
    db = open_database(f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'state.db'}")
    yield Control(db, settings=load_settings(host_id="fuzz-host")), db
    db.close()


_FUZZ = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@_FUZZ
@given(value=hostile)
def test_plan_input_is_a_card_or_invalid_input_and_a_refusal_writes_nothing(
    world: tuple[Control, Database], value: Any
) -> None:
    control, db = world
    before = (count(db, "journal_events"), count(db, "control_plans"))
    try:
        card = control.plan(release_plan(), input={"v": value})
    except InvalidInput as exc:
        event(f"refused: {exc.details['bound']}")
        assert (count(db, "journal_events"), count(db, "control_plans")) == before
        return
    event("card")
    assert canonical_bytes(card.input) == canonical_bytes({"v": value})
    assert control.plan(release_plan(), input={"v": value}).plan_id == card.plan_id


@_FUZZ
@given(key=st.one_of(hostile_text, st.text(min_size=1000, max_size=1100), st.binary(max_size=4), st.none()))
def test_run_keys_are_a_receipt_or_invalid_input_and_a_refusal_writes_nothing(
    world: tuple[Control, Database], key: Any
) -> None:
    control, db = world
    card = control.plan(release_plan(plan_id="keys"))
    before = (count(db, "runs"), count(db, "control_receipts"))
    try:
        receipt = control.run(card, idempotency_key=key)
    except InvalidInput as exc:
        event(f"refused: {exc.details['bound']}")
        assert exc.details["bound"] == "idempotency_key"
        assert (count(db, "runs"), count(db, "control_receipts")) == before
        return
    event("receipt")
    assert isinstance(receipt, (Accepted, AlreadyApplied))
