"""What a finished Prefect task run returned, read from its state in memory.

With ``persist_result=False`` (every task smthrs builds) the value stays inside the state's ``ResultRecord``:
read it there, as ``State.result`` itself does, without that method's hop through Prefect's event-loop thread (a
measurable share of a no-op node). Any other shape (a result Prefect must fetch, an exception state without
data) takes ``State.result``'s full path, which returns (never raises) the exception of a failed run.
"""

from __future__ import annotations

from typing import Any

__all__ = ["returned"]


def returned(state: Any) -> Any:
    """The value (or exception) a finished task run's ``state`` carries."""
    from prefect.results import ResultRecord

    data = state.data
    if isinstance(data, ResultRecord) and state.is_final():
        return data.result
    return state.result(raise_on_failure=False)
