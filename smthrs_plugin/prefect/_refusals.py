"""A step's refusal is told once: logged by the step, and Prefect's echoes of it point at that record.

A typed error (:class:`~smthrs_plugin.errors.SmthrsError`) a ``@step`` call raises is logged once, on the task
run's logger (:func:`told`), and re-raised untouched. Prefect then logs the same exception four more times — the
task run's failure (with a traceback of plugin frames), its final state, the flow run's failure and its final
state — each repeating the whole text. :class:`_RefusalEchoes`, a filter on Prefect's run loggers, rewrites those
to point at the one record (the state, the exception and its type are kept). A body's own exception is Prefect's
to log, as for any task.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import prefect

from ..errors import SmthrsError

__all__ = ["told"]

log = logging.getLogger("smthrs_plugin.prefect.step")


#: The ``extra`` attribute marking the one record that tells a refusal (never rewritten by :class:`_RefusalEchoes`).
_TELLS_REFUSAL = "smthrs_refusal"
#: Refusals remembered by the echo filter (the newest): a bound on memory, not on correctness.
_ECHOES_KEPT = 32


class _RefusalEchoes(logging.Filter):
    """A step's refusal is logged once, by the step (:func:`told`). Prefect then logs the same exception again —
    the task run's failure (with a traceback of our frames), its final state, the flow run's failure (traceback
    again) and its final state — each repeating the refusal's whole text. This filter, on Prefect's run loggers,
    rewrites those echoes to point at the one record instead (the state, the exception and its type are kept)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._told: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def add(self, exc: SmthrsError) -> None:
        name = type(exc).__name__
        pairs = [(repr(exc), f"{name} (the refusal logged above)")]
        for text in (str(exc), exc.message):
            # A state's message is shown repr()-quoted: escaped quotes, newlines
            pairs += [(t, "see the refusal logged above") for t in (text, repr(text)[1:-1])]
        entry = (str(exc), tuple(pairs))
        with self._lock:
            self._told = ((*self._told, entry) if entry not in self._told else self._told)[-_ECHOES_KEPT:]

    def filter(self, record: logging.LogRecord) -> bool:
        told = self._told
        if not told or getattr(record, _TELLS_REFUSAL, False):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report, never this filter's
            return True
        echoed = False
        for refusal, pairs in told:
            for old, new in pairs:
                if old and old in text:
                    text, echoed = text.replace(old, new), True
            if isinstance(exc, SmthrsError) and str(exc) == refusal:
                echoed = True
                record.exc_info, record.exc_text = None, None  # the traceback is of our frames, told already
        if echoed:
            record.msg, record.args = text, ()
        return True


_ECHOES = _RefusalEchoes()
_ECHOES_INSTALLED: list[bool] = []
_ECHOES_LOCK = threading.Lock()


@contextlib.contextmanager
def told() -> Iterator[None]:
    """Log a refusal (a :class:`SmthrsError`) the step raises once — on the task run's logger when there is one —
    and re-raise it untouched; a body's own exception is Prefect's to log, as for any task."""
    try:
        yield
    except SmthrsError as exc:
        if not getattr(exc, "_smthrs_told", False):
            try:
                logger: Any = prefect.get_run_logger()
            except Exception:  # noqa: BLE001 - no run context (the body called as a plain function)
                logger = log
            logger.error("%s: %s", type(exc).__name__, exc, extra={_TELLS_REFUSAL: True})
            with _ECHOES_LOCK:
                if not _ECHOES_INSTALLED:
                    for name in ("prefect.task_runs", "prefect.flow_runs"):
                        logging.getLogger(name).addFilter(_ECHOES)
                    _ECHOES_INSTALLED.append(True)
            _ECHOES.add(exc)
            exc._smthrs_told = True  # type: ignore[attr-defined]  # a nested step re-raising it tells nothing
        raise
