"""``@sp.step``: a Prefect task whose body goes through the cache dispatch seam (flow authors).

::

    @sp.step(reads=["data/raw.csv"], writes=["data/clean.csv"])
    def clean(ws: sp.Workspace, threshold: float) -> dict: ...

What a call's key folds is in docs/rules.md ("What a ``@step``'s identity folds"). A caller relies on:

- **The key is the content.** An argument no codec handles is ``CacheError(key_uncomputable)`` naming it and the
  ``smthrs_value_codecs`` hook, before anything is written; a function whose source cannot be read is refused
  when decorated.
- **A building body is isolated** (``boundary.IsolatedCall``, ``isolation=``: namespace | process | thread) and
  sees only its sandbox through the parameter annotated ``Workspace``; declared writes are copied back
  compare-and-set. A hit starts no child and replays the outputs.
- **Always a value.** A call returns the step's value (a hit: the stored one), never a State unless
  ``return_state=True``; a hit's task run ends ``Completed`` named ``Cached``. A failed dispatch raises the
  step's own error, so Prefect's ``retries=`` retry it. An async step never blocks its event loop.
- **Prefect does not cache twice** (``cache_policy=NO_CACHE, persist_result=False``); ``cache_expiration``,
  ``refresh_cache``, ``cache_exclude`` and ``cache_value`` are honoured by smthrs, never folded into the key.
- **One smthrs run per flow run** (:mod:`._flowrun`): every call journals ``step-settled`` into it, fenced by the
  flow process's owner token. Events: :mod:`._events`. A typed refusal is logged once and re-raised untouched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import datetime
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypeVar

import prefect
from prefect.cache_policies import NO_CACHE

from ..boundary import ISOLATIONS, IsolatedCall, isolation_ran, record_isolation, resolve_isolation
from ..cache.requests import declaration_of
from ..canonical import canonical_bytes
from ..codecs import HOOK_NAME, CodecRegistry
from ..engine.context import waits_forbidden
from ..errors import CacheError, CanonicalError, CodecError, PlanError
from ..plan import NodeDraft, Value, node
from ..plan.keys import plan_key
from ..runtime import Runtime, process_codecs
from ..scheduler.job import error_line
from ..scheduler.model import Settlement
from . import _events
from ._flowrun import context_for_call
from ._reach import step_identity
from ._refusals import told
from ._remote import RemoteTarget, StepBody, coordinator_runner, execution_for
from ._stepjournal import build_ms, record_settled, remember_build
from ._steprequest import check_path_arguments, request_for
from ._taskstate import completed
from .environment import give_ephemeral_server_time
from .steprun import StepContext, describe_later, standalone_run
from .workspace import Workspace, with_workspace

__all__ = ["step", "Step", "Workspace", "CONTEXT_PARAM", "STEP_EVENT_PREFIX", "default_environment"]

#: The hidden keyword argument carrying the :class:`StepContext` to wherever the body runs.
CONTEXT_PARAM = "smthrs_context"
#: Prefect events of step calls are ``smthrs.step.built | clean | failed`` (catalogue: :mod:`._events`).
STEP_EVENT_PREFIX = _events.STEP_PREFIX
_RESERVED = {CONTEXT_PARAM, "return_state", "wait_for"}
#: Prefect options that would make Prefect cache or persist on its own: the plugin owns caching. (Prefect's
#: ``cache_expiration`` and ``refresh_cache``, and ``cache_policy=NO_CACHE`` alone, are taken: :data:`_STEP_OPTIONS`.)
_REFUSED_OPTIONS = {
    "cache_policy",
    "cache_key_fn",
    "persist_result",
    "result_storage",
    "result_storage_key",
    "result_serializer",
    "cache_result_in_memory",
}
#: Options ``step()`` and ``with_options`` take that the smthrs cache honours (never passed to Prefect).
_STEP_OPTIONS = ("cache_expiration", "refresh_cache", "cache_exclude", "cache_value", "isolation")

F = TypeVar("F", bound=Callable[..., Any])
#: The message prefix of the ``Cached`` state a hit's body returns: how a direct call recognises the state to unwrap.
_HIT_MESSAGE = "smthrs: verified cache hit "

log = logging.getLogger(__name__)


def default_environment() -> dict[str, Any]:
    """What a step's key folds as its environment unless told more: the Python implementation and version."""
    impl = sys.implementation.name
    return {"python": f"{impl}-{sys.version_info.major}.{sys.version_info.minor}"}


def _is_workspace(ann: Any) -> bool:
    if ann is Workspace or (isinstance(ann, type) and issubclass(ann, Workspace)):
        return True
    return isinstance(ann, str) and (ann == "Workspace" or ann.endswith(".Workspace"))


def _takes_workspace(params: list[inspect.Parameter]) -> list[str]:
    """The names of the parameters annotated ``Workspace`` (whatever their position; ``*args``/``**kwargs``
    never are one)."""
    return [
        p.name
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and _is_workspace(p.annotation)
    ]


class _StepSpec:
    """Everything a call needs, computed once at decoration (pickles with the task)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        reads: tuple[Any, ...],
        writes: tuple[Any, ...],
        removes: tuple[Any, ...],
        boundary: str,
        tier: str,
        nondeterministic: bool,
        environment: Mapping[str, Any] | None,
        isolation: str | None = None,
        cache_expiration: Any = None,
        refresh_cache: Any = None,
        cache_exclude: Any = (),
        cache_value: Any = True,
        no_cache: bool = False,
    ) -> None:
        self.fn = fn
        #: ``auto | namespace | process | thread`` (None: the runtime's ``SMTHRS_ISOLATION``); never keyed.
        self.isolation = isolation
        if isolation is not None and isolation not in ISOLATIONS:
            raise CacheError(
                "invalid_declaration",
                f"@step {fn.__qualname__}: isolation={isolation!r} is not one of {', '.join(ISOLATIONS)}",
            )
        self.name = name
        # Its module as imported (``__main__`` too), its source and every project module and installed
        # distribution its code reaches (``_reach``); only plain data is kept, so the spec still pickles.
        reached = step_identity(fn)
        self.identity = reached.identity
        self.source_digest = reached.source_digest
        # An async step's task body is a coroutine function too (Prefect then builds an async task run).
        self.is_async = inspect.iscoroutinefunction(fn)
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        named = _takes_workspace(params)
        if len(named) > 1:
            raise CacheError(
                "invalid_declaration",
                f"step {self.identity}: parameters {', '.join(named)} are all annotated Workspace, but a step"
                " receives one workspace; keep one",
                step=self.identity,
            )
        #: The parameter the body receives its :class:`Workspace` in, whatever its position (never an argument of
        #: the call, never keyed), or None. ``_workspace_at``: its index when it is positional.
        self.workspace_param: str | None = named[0] if named else None
        self._workspace_at: int | None = next(
            (
                i
                for i, p in enumerate(params)
                if p.name == self.workspace_param and p.kind is not inspect.Parameter.KEYWORD_ONLY
            ),
            None,
        )
        visible = [p for p in params if p.name != self.workspace_param]
        for p in visible:
            if p.name in _RESERVED:
                raise CacheError(
                    "invalid_declaration",
                    f"step {self.identity}: parameter name {p.name!r} is reserved ({', '.join(sorted(_RESERVED))});"
                    " rename it",
                    step=self.identity,
                )
        self.call_signature = sig.replace(parameters=visible)
        hidden = inspect.Parameter(CONTEXT_PARAM, inspect.Parameter.KEYWORD_ONLY, default=None)
        with_hidden = [p for p in visible if p.kind is not inspect.Parameter.VAR_KEYWORD]
        with_hidden.append(hidden)
        with_hidden += [p for p in visible if p.kind is inspect.Parameter.VAR_KEYWORD]
        self.task_signature = sig.replace(parameters=with_hidden)
        self.body = {"step": reached.key_material()}
        self.reads, self.writes, self.removes = reads, writes, removes
        self.boundary, self.tier, self.nondeterministic = boundary, tier, nondeterministic
        self.environment = dict(environment) if environment is not None else None
        self._freshness(visible, cache_expiration, refresh_cache, cache_exclude, cache_value, no_cache)
        # Refuse bad effects now, before any call writes anything (the boundary declaration also refuses writes
        # and removals under the reserved .smthrs/, .git/, .venv/).
        self.draft({}, boundary_check=True)

    def _freshness(
        self,
        visible: list[inspect.Parameter],
        cache_expiration: Any,
        refresh_cache: Any,
        cache_exclude: Any,
        cache_value: Any,
        no_cache: bool,
    ) -> None:
        """Check and keep the options that say when an entry is served and what it stores (none is keyed)."""

        def invalid(message: str) -> CacheError:
            return CacheError("invalid_declaration", f"step {self.identity}: {message}", step=self.identity)

        if cache_expiration is not None and (
            not isinstance(cache_expiration, datetime.timedelta) or cache_expiration <= datetime.timedelta(0)
        ):
            raise invalid(
                f"cache_expiration={cache_expiration!r} is not a positive datetime.timedelta (or None: never)"
            )
        if refresh_cache is not None and not isinstance(refresh_cache, bool):
            raise invalid(f"refresh_cache={refresh_cache!r} is not True, False or None (Prefect's setting)")
        if not isinstance(cache_value, bool):
            raise invalid(f"cache_value={cache_value!r} is not True or False")
        if isinstance(cache_exclude, str) or not isinstance(cache_exclude, Iterable):
            raise invalid(f"cache_exclude={cache_exclude!r} is not a list of parameter names")
        cache_exclude = tuple(cache_exclude)
        if not all(isinstance(n, str) for n in cache_exclude):
            raise invalid(f"cache_exclude={list(cache_exclude)!r} is not a list of parameter names")
        names = [p.name for p in visible]
        unknown = [n for n in cache_exclude if n not in names]
        if unknown:
            raise invalid(
                f"cache_exclude names {', '.join(map(repr, unknown))}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of the step (its keyed "
                f"parameters: {', '.join(names) or 'none'})"
            )
        self.cache_expiration: datetime.timedelta | None = cache_expiration
        self.refresh_cache: bool | None = refresh_cache
        self.cache_exclude: frozenset[str] = frozenset(cache_exclude)
        self.cache_value: bool = cache_value
        self.no_cache: bool = bool(no_cache)
        # What every request of this step carries (never folded into its key: cache/_model.DispatchRequest).
        max_age_ms = None
        if cache_expiration is not None:
            max_age_ms = max(1, cache_expiration // datetime.timedelta(milliseconds=1))
        self.request_options: dict[str, Any] = {
            "max_age_ms": max_age_ms,
            "no_cache": self.no_cache,
            "require_cacheable_value": True,
            "discard_value": not cache_value,
        }

    def body_arguments(
        self, root: Path, bound: inspect.BoundArguments
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments to call :attr:`fn` with: the call's ``bound`` arguments (bound to
        :attr:`call_signature`, defaults applied) with a :class:`Workspace` rooted at ``root`` inserted as the
        workspace parameter, at its own position or by its name."""
        return with_workspace(
            tuple(bound.args), dict(bound.kwargs), self.workspace_param, self._workspace_at, root
        )

    def draft(self, arguments: Mapping[str, Any], *, boundary_check: bool = False) -> NodeDraft:
        try:
            d = node(
                self.name,
                body=self.body,
                inputs=[Value(dict(arguments))],
                reads=self.reads,
                writes=self.writes,
                removes=self.removes,
                boundary=self.boundary,  # type: ignore[arg-type]
                tier=self.tier,  # type: ignore[arg-type]
                nondeterministic=self.nondeterministic or None,
            )
            if boundary_check:
                declaration_of(d)
            return d
        except PlanError as exc:
            raise CacheError(
                "invalid_declaration", f"step {self.identity}: {exc.message}", cause=exc, step=self.identity
            ) from exc

    def arguments(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], codecs: CodecRegistry | None = None
    ) -> tuple[inspect.BoundArguments, dict[str, Any]]:
        """Bind a call and compute every argument's key form (the key folds their canonical values): plain JSON
        as itself, typed values through the value codecs (``codecs``; default: the process's registry, built-ins
        + plugins). The body still receives the original values (``bound``)."""
        bound, values, _ = self.keyed_arguments(args, kwargs, codecs)
        return bound, values

    def keyed_arguments(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any], codecs: CodecRegistry | None = None
    ) -> tuple[inspect.BoundArguments, dict[str, Any], bytes]:
        """:meth:`arguments` plus the canonical bytes of all the key forms together (what the request memo is
        keyed on: equal bytes, equal key inputs)."""
        try:
            bound = self.call_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise CacheError(
                "invalid_declaration", f"step {self.identity}: {exc}", cause=exc, step=self.identity
            ) from exc
        bound.apply_defaults()
        registry = codecs if codecs is not None else process_codecs()
        # cache_exclude: the body receives these arguments, the key never sees them (nor needs a key form).
        keyed = [(n, v) for n, v in bound.arguments.items() if n not in self.cache_exclude]
        try:
            values = {name: registry.key_form(value) for name, value in keyed}
            return bound, values, canonical_bytes(values)
        except (CodecError, CanonicalError):
            pass
        # Name the first argument (in order) that has no key form or no canonical form.
        for name, value in keyed:
            try:
                canonical_bytes(registry.key_form(value))
            except (CodecError, CanonicalError) as exc:
                raise CacheError(
                    "key_uncomputable",
                    f"step {self.identity}: argument {name!r} (a {type(value).__module__}.{type(value).__qualname__})"
                    f" has no key: {exc.message}. Pass plain data or a type with a value codec (register one through"
                    f" the `{HOOK_NAME}` plugin hook), write the object to a file and declare that file in"
                    f" reads=[...], or, if it cannot change the result (a client, a session), leave it out of the"
                    f" key: @sp.step(cache_exclude=[{name!r}])",
                    cause=exc,
                    step=self.identity,
                    argument=name,
                ) from exc
        raise CacheError(  # pragma: no cover - every argument has a canonical form, so has the mapping of them
            "key_uncomputable",
            f"step {self.identity}: its arguments have no canonical form",
            step=self.identity,
        )

    def environment_for(self, runtime_defaults: Mapping[str, Any]) -> dict[str, Any]:
        env = default_environment()
        base = runtime_defaults.get("environment")
        if isinstance(base, Mapping):
            env.update(base)
        if self.environment:
            env.update(self.environment)
        return env


def _task_run_ids() -> tuple[str | None, int]:
    from prefect.context import TaskRunContext

    trc = TaskRunContext.get()
    if trc is None or trc.task_run is None:
        return None, 1
    return str(trc.task_run.id), max(1, int(trc.task_run.run_count or 1))


def _run_step(
    spec: _StepSpec,
    ctx: StepContext | None,
    as_state: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_loop: _BodyOnLoop | None = None,
    remote: Any = None,
) -> Any:
    bound, values, canonical = spec.keyed_arguments(args, kwargs)  # typed refusal before any write
    if ctx is None:
        ctx = context_for_call()
    scope = standalone_run(f"step/{spec.identity}") if ctx is None else nullcontext(ctx)
    with scope as run_ctx:
        return _dispatch(spec, run_ctx, as_state, bound, values, on_loop, canonical, remote)


def _dispatch(
    spec: _StepSpec,
    ctx: StepContext,
    as_state: bool,
    bound: inspect.BoundArguments,
    values: dict[str, Any],
    on_loop: _BodyOnLoop | None,
    canonical: bytes,
    remote: Any = None,
) -> Any:
    rt = ctx.spec.open()
    # Remote execution (the flow's runner is out of process and the workspace not shared, ``_remote.py``): the
    # seam runs here, the body on a worker. A store the workers cannot reach is refused before anything is written.
    target = None if remote is None else RemoteTarget.of(remote, rt.artifacts, ctx.spec.execution)
    task_run_id, attempt = _task_run_ids()
    env = spec.environment_for(rt.plugins.runtime_defaults(rt.settings))
    draft, request = request_for(spec, rt, ctx.run_id, attempt, values, canonical, env)
    check_path_arguments(spec, bound, rt.workspace, request.declaration)
    # No owner on the request: the cache rows are content-addressed facts, not the run's state; the run's own
    # record (step-settled) is written fenced by the owner token below (hits batched, see _stepjournal).

    def execute(root: Path) -> Any:
        if target is not None:
            record_isolation("remote")
            shipped = StepBody(
                spec.fn, spec.workspace_param, spec._workspace_at, tuple(bound.args), dict(bound.kwargs)
            )
            return target.run(f"{spec.name} · remote", shipped, root)
        kind = resolve_isolation(
            spec.isolation or rt.settings.isolation, subject=spec.identity, workspace=rt.workspace
        )
        call = IsolatedCall(rt.workspace, root, request.declaration, kind, subject=spec.identity)
        # In a namespace the workspace's own path shows the sandbox (the sandbox path itself may be hidden).
        view = Path(rt.workspace) if kind == "namespace" else root

        def body() -> Any:
            with waits_forbidden(f"the body of @step {spec.identity!r}"):
                call_args, call_kwargs = spec.body_arguments(view, bound)
                out = spec.fn(*call_args, **call_kwargs)
                # An async step in this thread: its coroutine runs on the task run's loop while this thread
                # waits for it. In an isolated child the coroutine is returned and run on a loop of its own.
                if on_loop is not None and kind == "thread":
                    return on_loop.run(out)
                return out

        if on_loop is None:
            return call.run(body)
        with on_loop.isolated(call):
            return call.run(body)

    result = rt.dispatcher.dispatch(request, execute)
    payload = _payload(spec, result, attempt, task_run_id, isolation_ran())
    record_settled(rt, ctx.run_id, ctx.owner, payload, hit=result.outcome == "clean")
    # A hit returned as OUR Cached state inside a task run: that state (its message names the key) is what
    # Prefect shows and records for the call; a smthrs.step.clean event would say it a second time.
    cached_state = result.outcome == "clean" and as_state and task_run_id is not None
    _tell(spec, ctx, rt, draft, result, attempt, task_run_id, event=not cached_state)
    if result.outcome == "failed":
        err = result.error
        if isinstance(err, BaseException):
            raise err
        raise CacheError("not_found", f"step {spec.identity} failed without an error")  # pragma: no cover
    if result.outcome == "clean" and as_state:
        return completed(result.value, name="Cached", message=_cached_message(rt, result))
    return result.value


def _cached_message(rt: Runtime, result: Any) -> str:
    """The message of a hit's ``Cached`` state: the key, the tier that served it and the time it saved (how long
    the original execution ran, when this database recorded that build)."""
    tier = getattr(result.decision, "tier", None) or "unknown"
    saved = build_ms(rt, result.key)
    said = "time saved not recorded here" if saved is None else f"saved {saved / 1000:.3f} s of execution"
    return f"{_HIT_MESSAGE}{result.key}; {tier} tier; {said}"


def _payload(
    spec: _StepSpec, result: Any, attempt: int, task_run_id: str | None, isolation: str | None = None
) -> dict[str, Any]:
    """The ``step-settled`` record (plain JSON). ``isolation``: how the body ran (absent on a hit: none ran)."""
    payload: dict[str, Any] = {
        "step": spec.identity,
        "node": spec.name,
        "dispatch_key": result.key,
        "outcome": result.outcome,
        "decision": None if result.decision is None else result.decision.tag,
        "attempt": attempt,
    }
    if isolation is not None:
        payload["isolation"] = isolation
    tier = getattr(result.decision, "tier", None)
    if tier is not None:
        payload["tier"] = tier  # where a verified hit came from: local | shared | attempt
    if task_run_id is not None:
        payload["task_run_id"] = task_run_id
    if result.error is not None:
        payload["error"] = error_line(result.error)
    payload["ms"] = round(sum(dict(result.timings).values()), 3)
    if result.outcome == "built" and "execute" in result.timings:
        # How long the body ran: what a later hit of this key reports as saved (no key folds it).
        payload["execute_ms"] = round(float(result.timings["execute"]), 3)
        remember_build(result.key, payload["execute_ms"])
    return payload


def _tell(
    spec: _StepSpec,
    ctx: StepContext,
    rt: Runtime,
    draft: NodeDraft,
    result: Any,
    attempt: int,
    task_run_id: str | None,
    *,
    event: bool = True,
) -> None:
    """Mirror the settlement to plugins' observers and (``event``) as a Prefect event (never changes the
    outcome)."""
    decision = None if result.decision is None else result.decision.tag
    if rt.plugins.has_observers("smthrs_node_settled"):
        rt.plugins.notify_node_settled(
            ctx.run_id,
            None,
            Settlement(
                node=spec.name,
                outcome=result.outcome,
                plan_key=plan_key(draft, {}),
                dispatch_key=result.key,
                attempts=attempt,
                rebases=0,
                cache_decision=decision,
                error=error_line(result.error),
            ),
        )
    if event:
        _events.emit(
            _events.step_settled(
                run_id=ctx.run_id,
                step=spec.identity,
                node=spec.name,
                attempt=attempt,
                dispatch_key=result.key,
                outcome=result.outcome,
                cache_decision=decision,
                tier=getattr(result.decision, "tier", None),
                error=error_line(result.error),
                timings_ms=dict(result.timings),
                task_run_id=task_run_id,
                flow_run_id=ctx.flow_run_id,
            )
        )
    _events.emit(
        _events.cache_refused(
            run_id=ctx.run_id,
            subject=spec.identity,
            kind="step",
            dispatch_key=result.key,
            decision=result.decision,
            outcome=result.outcome,
            task_run_id=task_run_id,
            flow_run_id=ctx.flow_run_id,
            subject_resource=_events.step_resource_id(spec.identity),
        )
    )
    if ctx.flow_run_id is not None and ctx.owner.pid == os.getpid():
        # A @step flow run has no Report: its page names its smthrs run once (the flow run's own process only;
        # a worker process would attach a duplicate version of the same artifact).
        describe_later(ctx.run_id, ctx.flow_run_id)


class _Call:
    """The hidden argument: the run context, whether a hit may be returned as a ``Cached`` state, and — for
    remote execution — the flow's task runner the body is shipped to (never pickled: a remote call's own task
    run stays in the coordinator's process)."""

    __slots__ = ("ctx", "as_state", "remote")

    def __init__(self, ctx: StepContext | None, as_state: bool, remote: Any = None) -> None:
        self.ctx = ctx
        self.as_state = as_state
        self.remote = remote

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Call, (self.ctx, self.as_state))

    def __repr__(self) -> str:
        return f"<smthrs call {self.ctx!r}>"


class _BodyOnLoop:
    """Runs an async step's coroutine on the event loop of its task run, for the dispatch thread that waits for it.

    The dispatch thread calls :meth:`run` from inside ``execute`` (sandbox ready, wait ban set): the coroutine is
    scheduled on ``loop`` with that thread's context (``call_soon_threadsafe`` copies it), so the body sees the
    task run's Prefect context and the wait ban exactly as a sync body does. :meth:`cancel` (the awaiting task was
    cancelled) cancels a running body, or refuses one that has not started yet."""

    __slots__ = ("loop", "_lock", "_future", "_cancelled", "_child")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._future: concurrent.futures.Future[Any] | None = None
        self._cancelled = False
        self._child: IsolatedCall | None = None

    @contextlib.contextmanager
    def isolated(self, call: IsolatedCall) -> Iterator[None]:
        """While ``call`` runs, a cancellation kills its child (an isolated body runs on a loop of its own)."""
        with self._lock:
            if self._cancelled:
                call.kill()
            self._child = call
        try:
            yield
        finally:
            with self._lock:
                self._child = None

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        with self._lock:
            if self._cancelled:
                coro.close()
                raise concurrent.futures.CancelledError(
                    "the task run was cancelled before the step body started"
                )
            self._future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return self._future.result()  # the body's own exception, or CancelledError if it was cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._future is not None:
                self._future.cancel()
            if self._child is not None:
                self._child.kill()


async def _settle_in_thread(
    spec: _StepSpec, call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run an async step's dispatch in a thread of its own (one per call: concurrent awaits stay concurrent, no
    capped pool) while this coroutine awaits it without blocking the loop; the body runs back on this loop."""
    loop = asyncio.get_running_loop()
    on_loop = _BodyOnLoop(loop)
    settled: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()  # the task run's context: Prefect's TaskRunContext, the flow run

    def deliver(ok: bool, value: Any) -> None:
        if settled.done():  # pragma: no cover - only this thread settles it
            return
        if ok:
            settled.set_result(value)
        else:
            settled.set_exception(value)

    def work() -> None:
        try:
            outcome: tuple[bool, Any] = (
                True,
                context.run(_run_step, spec, call.ctx, call.as_state, args, kwargs, on_loop, call.remote),
            )
        except BaseException as exc:
            # Handed to the awaiting task as is: the step's own error, re-raised there, never swallowed.
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(deliver, *outcome)
        except RuntimeError:  # the loop is closed: nobody awaits this call any more; its dispatch has settled
            log.warning("step %s settled after its event loop closed: %r", spec.identity, outcome[1])

    threading.Thread(target=work, name=f"smthrs-step-{spec.name}").start()
    try:
        return await asyncio.shield(settled)
    except asyncio.CancelledError:
        # The task run was cancelled (timeout, flow cancellation): cancel the body, then let the dispatch settle —
        # it journals the cancelled body as a failed build — before the cancellation propagates, so no copy-back
        # or record outlives the task run. The cancellation, not the body's CancelledError, is what propagates.
        on_loop.cancel()
        await asyncio.wait([settled])
        if not settled.cancelled():
            settled.exception()  # retrieved (journaled as the failure) so asyncio does not report it unretrieved
        raise


def _placed_call() -> tuple[_Call, Any]:
    """The hidden argument of a call made now, and the runner its task run must go to: ``None`` for the flow's
    own runner; the coordinator-side runner under remote execution (``_remote.execution_for`` on the flow's
    runner and the step settings' ``execution``)."""
    ctx = context_for_call()
    if ctx is None:
        return _Call(None, True), None
    from prefect.context import FlowRunContext

    frc = FlowRunContext.get()
    runner = None if frc is None else frc.task_runner
    if execution_for(runner, ctx.spec.execution) != "remote":
        return _Call(ctx, True), None
    return _Call(ctx, True, remote=runner), coordinator_runner()


def _value_of(out: Any) -> Any:
    """The value of a direct call: a hit's body returned OUR ``Cached`` state (so the task run shows Cached) and
    Prefect hands that state back to a direct call — unwrap it; anything else is already the value."""
    from prefect.client.schemas.objects import State

    if not (isinstance(out, State) and out.name == "Cached" and (out.message or "").startswith(_HIT_MESSAGE)):
        return out
    from prefect.results import ResultRecord

    data = out.data
    return data.result if isinstance(data, ResultRecord) else data


async def _awaited_value(out: Coroutine[Any, Any, Any]) -> Any:
    return _value_of(await out)


def _make_body(spec: _StepSpec) -> Callable[..., Any]:
    def sync_body(*args: Any, **kwargs: Any) -> Any:
        call = kwargs.pop(CONTEXT_PARAM, None)
        if call is None:
            call = _Call(None, False)
        with told():
            return _run_step(spec, call.ctx, call.as_state, args, kwargs, remote=call.remote)

    async def async_body(*args: Any, **kwargs: Any) -> Any:
        call = kwargs.pop(CONTEXT_PARAM, None)
        if call is None:
            call = _Call(None, False)
        with told():
            return await _settle_in_thread(spec, call, args, kwargs)

    body: Callable[..., Any] = async_body if spec.is_async else sync_body
    body.__name__ = spec.fn.__name__
    body.__qualname__ = spec.fn.__qualname__
    body.__module__ = spec.fn.__module__
    body.__doc__ = spec.fn.__doc__
    body.__signature__ = spec.task_signature  # type: ignore[attr-defined]
    return body


def _split_options(
    spec_options: Mapping[str, Any], task_options: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Move the options smthrs honours out of the Prefect task options (``with_options`` passes them there):
    :data:`_STEP_OPTIONS`, and Prefect's ``cache_policy`` when it is ``NO_CACHE`` (any other policy stays, to be
    refused)."""
    spec, task = dict(spec_options), dict(task_options)
    for name in _STEP_OPTIONS:
        if name in task:
            spec[name] = task.pop(name)
    if "cache_policy" in task and type(task["cache_policy"]) is type(NO_CACHE):
        del task["cache_policy"]
        spec["no_cache"] = True
    return spec, task


class Step(prefect.Task):  # type: ignore[type-arg]
    """A Prefect task whose body goes through the smthrs cache (see the module docstring). Build it with
    :func:`step`."""

    def __init__(
        self, fn: Callable[..., Any], *, spec_options: Mapping[str, Any], task_options: Mapping[str, Any]
    ) -> None:
        spec_options, task_options = _split_options(spec_options, task_options)
        refused = sorted(set(task_options) & _REFUSED_OPTIONS)
        if refused:
            raise CacheError(
                "invalid_declaration",
                f"@step does not take Prefect caching options {refused}: smthrs owns caching (Prefect's is off for"
                " steps); remove them",
            )
        spec = _StepSpec(fn, **spec_options)
        from ..cache.admission import declared_run_local_reason

        # Said once here: otherwise every call of such a step misses in each new run and explains nothing.
        if (run_local := declared_run_local_reason(spec.draft({}))) is not None:
            log.warning(
                "@step %s is cached only within its run, never across runs: %s", spec.identity, run_local
            )
        self.step_spec = spec
        self._spec_options = dict(spec_options)
        self._task_options = dict(task_options)
        # No implicit tag: every tagged task run acquires (and releases) Prefect concurrency slots through the API,
        # ~2 round trips per call — the user's own tags opt into that, we do not impose it.
        super().__init__(
            _make_body(spec),
            name=spec.name,
            cache_policy=NO_CACHE,
            persist_result=False,
            **task_options,
        )

    def __call__(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run the step as a task run and return its value (a coroutine of it for an async step). A hit's task
        run ends ``Cached``; Prefect then returns that state to a direct call, which is unwrapped here. A failure
        raises the step's own error (Prefect's ``result`` path re-raises it untouched)."""
        call, _ = _placed_call()
        kwargs[CONTEXT_PARAM] = call
        out = super().__call__(*args, return_state=return_state, wait_for=wait_for, **kwargs)
        if return_state:
            return out
        if inspect.iscoroutine(out):
            return _awaited_value(out)
        return _value_of(out)

    def submit(self, *args: Any, return_state: bool = False, wait_for: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """As ``Task.submit``. Under remote execution the call's task run runs on this process's coordinator-side
        runner (its seam needs the workspace) and ships only the body to the flow's runner."""
        call, local = _placed_call()
        kwargs[CONTEXT_PARAM] = call
        if local is None:
            return super().submit(*args, return_state=return_state, wait_for=wait_for, **kwargs)
        from prefect.utilities.callables import get_call_parameters

        future = local.submit(self, get_call_parameters(self.fn, args, kwargs), wait_for)
        if return_state:
            future.wait()
            return future.state
        return future

    def map(
        self,
        *args: Any,
        return_state: bool = False,
        wait_for: Any = None,
        deferred: bool = False,
        **kwargs: Any,
    ) -> Any:  # type: ignore[override]
        call, local = _placed_call()
        kwargs[CONTEXT_PARAM] = call
        if local is None or deferred:
            return super().map(
                *args, return_state=return_state, wait_for=wait_for, deferred=deferred, **kwargs
            )
        from prefect.utilities.callables import get_call_parameters

        futures = local.map(self, get_call_parameters(self.fn, args, kwargs, apply_defaults=False), wait_for)
        if return_state:
            states = []
            for future in futures:
                future.wait()
                states.append(future.state)
            return states
        return futures

    def with_options(self, **options: Any) -> Step:  # type: ignore[override]
        """A copy with other Prefect options (``name=`` also renames the step node); caching options refused but
        for the freshness and storage options :func:`step` takes (``cache_expiration``, ``refresh_cache``,
        ``cache_exclude``, ``cache_value``, ``cache_policy=NO_CACHE``)."""
        spec_options = dict(self._spec_options)
        if "name" in options:
            spec_options["name"] = options.pop("name")
        return Step(
            self.step_spec.fn, spec_options=spec_options, task_options={**self._task_options, **options}
        )

    def __repr__(self) -> str:
        return f"Step({self.step_spec.identity})"


def step(
    fn: F | None = None,
    *,
    reads: Iterable[Any] = (),
    writes: Iterable[Any] = (),
    removes: Iterable[Any] = (),
    boundary: str = "hard",
    tier: str = "sealed",
    name: str | None = None,
    nondeterministic: bool = False,
    environment: Mapping[str, Any] | None = None,
    isolation: str | None = None,
    cache_expiration: datetime.timedelta | None = None,
    refresh_cache: bool | None = None,
    cache_exclude: Iterable[str] = (),
    cache_value: bool = True,
    **task_options: Any,
) -> Any:
    """Turn ``fn`` into a cached Prefect task (see the module docstring).

    The parameter annotated ``sp.Workspace`` (``ws: sp.Workspace``, in any position, positional or keyword-only)
    receives the sandbox's workspace; it is not an argument of the call and never keyed.
    ``reads`` / ``writes`` / ``removes``: workspace-relative paths, globs (``"src/**"``) or trees (``"dist/"``); a
    declared exact read that does not exist is refused before the body runs (``CacheError(missing_read)``: a typo
    in ``reads=`` never runs silently), a glob or tree may match nothing;
    ``boundary``: ``"hard"`` refuses undeclared writes, ``"expected"`` records them (never shared); ``tier``:
    ``"sealed"`` (shared cache), ``"compensable"`` / ``"irreversible"`` (replayed inside one flow run only);
    ``name``: the task and node name (default: the function name); ``environment``: plain JSON added to the key;
    ``nondeterministic``: keep the first result published for a key instead of refusing a different one;
    ``isolation``: how a building body is kept from the live workspace — ``"namespace"`` (a forked child in a
    private mount namespace where the workspace path shows the sandbox), ``"process"`` (a forked child whose
    working directory is the sandbox; Python opens of workspace paths outside it refused), ``"thread"`` (in the
    calling thread, same refusals, files only through ``ws``: for a body that must share in-process objects),
    ``"auto"`` (namespace where the kernel allows it, else process); None (default): ``SMTHRS_ISOLATION``;
    ``task_options``: any other ``prefect.task`` option (``retries``, ``retry_delay_seconds``, ``tags``,
    ``timeout_seconds``, ``task_run_name`` ...) — Prefect's own caching and persistence options are refused, but
    for the ones below.

    Freshness and storage, with Prefect's names (none is folded into the key: changing one never orphans an
    entry; ``with_options`` takes them too):

    - ``cache_expiration``: a positive ``datetime.timedelta``. An entry created longer ago than this (measured by
      the runtime's clock against the entry's creation time, in the local and the shared tier alike) is not
      served: the call is a ``Miss`` whose reason is ``expired`` (``smthrs cache explain`` shows the old entry's
      age and the limit), the body runs and its result replaces the entry, even when it differs. None (default):
      entries never expire. For a body whose result depends on the world, not only on its inputs (an HTTP fetch,
      the clock).
    - ``refresh_cache``: True: the body always runs and its result replaces the entry, so later calls hit the new
      one (the old entry is invalidated when the call starts: a failed refresh leaves none to serve). False: never.
      None (default): Prefect's setting ``PREFECT_TASKS_REFRESH_CACHE``, read at each call.
    - ``cache_exclude``: names of parameters left out of the key. The body still receives their values, but calls
      that differ only in them share one entry, so a hit serves a result built with ANOTHER value: by excluding a
      parameter the author promises that its value does not change the result nor the outputs (a client, a
      session, a logger, a progress callback). Its value needs no key form (no codec; unpicklable is fine). A
      name that is not a parameter of the function is refused when decorating.
    - ``cache_policy=prefect.cache_policies.NO_CACHE``: nothing is served or stored — the body always runs (in its
      sandbox, declared writes copied back, the call journaled; its outcome is ``built``). Any other
      ``cache_policy`` is refused.
    - ``cache_value``: True (default): the return value is part of the cached result, and a value no value codec
      stores exactly fails the call at its first build with ``CacheError(value_uncacheable)`` (its declared writes
      are already copied back; nothing is cached) instead of going uncached silently. False: the return value is
      not cached — the outputs are, a hit replays them — and every call, built or hit, returns None, so no caller
      can come to depend on a value only a build returns."""

    def wrap(f: F) -> Step:
        if not callable(f) or inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
            raise CacheError(
                "invalid_declaration",
                f"@step decorates functions and coroutine functions (async def), not {f!r} (generator steps are "
                "not supported: a cached step returns one value); return a list instead",
            )
        spec_options = {
            "name": name or f.__name__,
            "reads": tuple(reads),
            "writes": tuple(writes),
            "removes": tuple(removes),
            "boundary": boundary,
            "tier": tier,
            "nondeterministic": nondeterministic,
            "environment": environment,
            "isolation": isolation,
            "cache_expiration": cache_expiration,
            "refresh_cache": refresh_cache,
            "cache_exclude": cache_exclude,
            "cache_value": cache_value,
        }
        # The author's own @flow starts Prefect's ephemeral server before any smthrs code runs: give it a busy
        # machine's budget now, unless the user chose one.
        give_ephemeral_server_time()
        return Step(f, spec_options=spec_options, task_options=task_options)

    return wrap(fn) if fn is not None else wrap
