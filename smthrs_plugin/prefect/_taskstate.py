"""What a finished Prefect task run returned, read from its state in memory, and the states a smthrs task body
returns with its value already in memory.

With ``persist_result=False`` (every task smthrs builds) the value stays inside the state's ``ResultRecord``:
read it there, as ``State.result`` itself does, without that method's hop through Prefect's event-loop thread (a
measurable share of a no-op node). Any other shape (a result Prefect must fetch, an exception state without
data) takes ``State.result``'s full path, which returns (never raises) the exception of a failed run.

A body that returns a state whose data is already a ``ResultRecord`` has it used as is (:func:`completed`,
:func:`failed`): Prefect would otherwise build one per task run — a storage key from a fresh random UUID and two
resolutions of the result storage path (system calls, each a chance to lose the GIL to another thread) — for a
record that ``persist_result=False`` never writes.
"""

from __future__ import annotations

from typing import Any

__all__ = ["returned", "completed", "failed"]


def returned(state: Any) -> Any:
    """The value (or exception) a finished task run's ``state`` carries."""
    from prefect.results import ResultRecord

    data = state.data
    if isinstance(data, ResultRecord) and state.is_final():
        return data.result
    return state.result(raise_on_failure=False)


def _in_memory(value: Any) -> Any:
    """An unpersisted ``ResultRecord`` of ``value`` with the current run's serializer (never written: no key)."""
    import prefect
    from prefect.results import ResultRecord, ResultRecordMetadata, get_result_store

    store = get_result_store()
    metadata = ResultRecordMetadata.model_construct(
        storage_key=None,
        expiration=None,
        serializer=store.serializer,
        prefect_version=prefect.__version__,
        storage_block_id=store.result_storage_block_id,
    )
    return ResultRecord.model_construct(metadata=metadata, result=value)


def completed(value: Any, **state: Any) -> Any:
    """A ``Completed`` state (``name``, ``message``...) carrying ``value`` in memory; call it inside the task run."""
    from prefect.states import Completed

    return Completed(data=_in_memory(value), **state)


def failed(value: Any, **state: Any) -> Any:
    """A ``Failed`` state carrying ``value`` in memory; call it inside the task run."""
    from prefect.states import Failed

    return Failed(data=_in_memory(value), **state)
