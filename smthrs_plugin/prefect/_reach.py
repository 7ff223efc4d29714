"""What a ``@step``'s identity folds, computed once when it is decorated (:func:`step_identity`).

Besides the function's ``module:qualname`` and the SHA-256 of its source: ``modules`` (``{module name: SHA-256 of
its file}`` for every project module the step reaches transitively) and ``distributions`` (``{distribution:
version}`` for every installed distribution providing a module it reaches). The exact rules are in docs/rules.md
("What a ``@step``'s identity folds").

- Named as imported (:func:`module_name_of`): a ``__main__`` function is named by the module name it has when
  imported.
- Of the step's own module only what its code names is folded; every other reached project module is folded whole.
- Reached, never run: names resolve from ``sys.modules``, else ``PathFinder``; nothing is imported.
- More than ``max_modules`` (default :data:`MAX_MODULES`) reached modules is ``CacheError(key_uncomputable)`` naming
  the roots, raised at decoration.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import importlib.metadata
import inspect
import os
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CacheError

__all__ = ["MAX_MODULES", "StepIdentity", "module_name_of", "name_from_path", "step_identity"]

#: The most modules (project and installed, the stdlib not counted) one step's identity may reach.
MAX_MODULES = 2000
_MAIN_NAMES = frozenset({"__main__", "__mp_main__"})  # __mp_main__: the script re-run in a spawned worker
#: The name Prefect's script loader gives a flow file whose stem is taken (``__prefect_loader_<digest>__``).
_LOADER_PREFIX = "__prefect_loader_"
_SELF_TOP = __name__.partition(".")[0]
_SELF_DIR = os.path.normcase(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
_INSTALL_DIRS = frozenset({"site-packages", "dist-packages"})
#: A file modified less than this long before it was read may change again without its stat changing.
_RACY_NS = 2_000_000_000
_PARSE_CAP = 8192


@dataclass(frozen=True)
class StepIdentity:
    """A step's identity material: ``modules`` and ``distributions`` are ``(name, digest or version)`` pairs
    sorted by name."""

    identity: str
    source_digest: str
    modules: tuple[tuple[str, str], ...]
    distributions: tuple[tuple[str, str], ...]

    def key_material(self) -> dict[str, Any]:
        """The plain-JSON ``body.step`` a step's key folds."""
        return {
            "function": self.identity,
            "source": self.source_digest,
            "modules": dict(self.modules),
            "distributions": dict(self.distributions),
        }


def step_identity(
    fn: Callable[..., Any],
    *,
    roots: Iterable[str | os.PathLike[str]] = (),
    max_modules: int = MAX_MODULES,
    packages: Mapping[str, Sequence[str]] | None = None,
    versions: Mapping[str, str] | None = None,
) -> StepIdentity:
    """The identity material of ``fn`` (see the module docstring).

    ``roots``: project roots besides the ``__main__`` script's directory and the function's own. ``packages``
    (top-level module → distributions) and ``versions`` (distribution → version) replace what
    ``importlib.metadata`` says. ``CacheError(key_uncomputable)`` when the function's source cannot be read or it
    reaches more than ``max_modules`` modules."""
    module, spec, file = _module_facts(fn)
    name = _import_name(module, spec, file)
    identity = f"{name}:{fn.__qualname__}"
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise CacheError(
            "key_uncomputable",
            f"step {identity}: its source cannot be read ({exc}), so its key cannot include it; define "
            "the function in a module or notebook cell whose source Python can read",
            cause=exc,
            step=identity,
        ) from exc
    walk = _Walk(identity, _roots(name, file, roots), max_modules)
    own = _own_module_digest(fn, walk)
    if own is None:
        walk.reach(name, file)  # something of its own module that cannot be folded alone: the whole file
    else:
        walk.seen.add(name)
        walk.modules[name] = own
    walk.drain()
    return StepIdentity(
        identity=identity,
        source_digest=hashlib.sha256(source.encode("utf-8")).hexdigest(),
        modules=tuple(sorted(walk.modules.items())),
        distributions=_distributions(walk.outside, packages, versions),
    )


def module_name_of(fn: Callable[..., Any]) -> str:
    """The name of ``fn``'s module as imported: its ``__module__``, except for the ``__main__`` script (see the
    module docstring)."""
    return _import_name(*_module_facts(fn))


def name_from_path(file: str, search_path: Iterable[str]) -> str:
    """The module name a file has when imported through ``search_path`` (``""`` is the current directory): its
    path relative to the entry holding it, every directory in between a package, extended up while the entry
    itself is a package directory; the longest such name; without one, its package chain or file stem."""
    real = _real(file)
    stem = os.path.splitext(os.path.basename(real))[0]
    best: list[str] | None = None
    for entry in search_path:
        base = _real(entry or os.getcwd())
        if real == base or not _under(real, base):
            continue
        rel = os.path.relpath(real, base).split(os.sep)
        parts = [*rel[:-1], stem]
        if not all(_is_package(os.path.join(base, *rel[:i])) for i in range(1, len(rel))):
            continue
        parts = _packaged(base, parts)
        if best is None or len(parts) > len(best):
            best = parts
    if best is None:
        best = _packaged(os.path.dirname(real), [stem])
    if len(best) > 1 and best[-1] == "__init__":
        best = best[:-1]
    return ".".join(best)


# -- names and roots ------------------------------------------------------------------------------------------


def _module_facts(fn: Callable[..., Any]) -> tuple[str, Any, str | None]:
    """``(__module__, __spec__, __file__)`` of the module ``fn`` was defined in (its globals are that module's)."""
    module = str(getattr(fn, "__module__", None) or "__main__")
    scope = getattr(fn, "__globals__", None)
    if not isinstance(scope, dict):
        scope = getattr(sys.modules.get(module), "__dict__", {})
    file = scope.get("__file__")
    return module, scope.get("__spec__"), file if isinstance(file, str) else None


def _placeholder(name: str) -> bool:
    """A name a runner gave the module instead of its own: the script's, or a loader's stand-in."""
    return name in _MAIN_NAMES or (name.startswith(_LOADER_PREFIX) and name.endswith("__"))


def _import_name(module: str, spec: Any, file: str | None) -> str:
    if not _placeholder(module):
        return module
    spec_name = getattr(spec, "name", None)
    if isinstance(spec_name, str) and not _placeholder(spec_name):
        return spec_name  # python -m pkg.mod
    if file is None:
        return module  # an interactive session or notebook: no import name to find
    return name_from_path(file, sys.path)


def _module_name(mod: Any) -> str | None:
    name = getattr(mod, "__name__", None)
    if not isinstance(name, str):
        return None
    file = getattr(mod, "__file__", None)
    return _import_name(name, getattr(mod, "__spec__", None), file if isinstance(file, str) else None)


def _packaged(base: str, parts: list[str]) -> list[str]:
    """``parts`` extended up through ``base`` and its ancestors while each is a package directory."""
    parts = list(parts)
    while _is_package(base) and os.path.dirname(base) != base:
        parts.insert(0, os.path.basename(base))
        base = os.path.dirname(base)
    return parts


def _is_package(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, "__init__.py"))


def _roots(name: str, file: str | None, extra: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    found = {_real(os.fspath(r)) for r in extra}
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(main_file, str):
        found.add(os.path.dirname(_real(main_file)))
    if file is not None:
        # The directory the top-level package is imported from: one level up per dotted part.
        top = os.path.dirname(_real(file))
        if os.path.splitext(os.path.basename(file))[0] == "__init__":
            top = os.path.dirname(top)
        for _ in range(name.count(".")):
            top = os.path.dirname(top)
        found.add(top)
    else:
        found.add(_real(os.getcwd()))  # a notebook or interactive session: its project is where it runs
    return tuple(sorted(found))


def _real(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {_real(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    return tuple(sorted(found | {_SELF_DIR}))


@functools.cache
def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({_real(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}))


def _installed(real: str) -> bool:
    return bool(_INSTALL_DIRS.intersection(real.split(os.sep))) or any(
        _under(real, r) for r in _installed_roots()
    )


def _stdlib(top: str, real: str | None) -> bool:
    if real is None:
        return top in sys.stdlib_module_names or top in sys.builtin_module_names
    in_stdlib = any(_under(real, r) for r in _stdlib_roots())
    return in_stdlib and not _INSTALL_DIRS.intersection(real.split(os.sep))


# -- what the function's code names ---------------------------------------------------------------------------


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _named_values(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    """The global values the function's code (nested code included) names, and its closure's contents, by name."""
    code = getattr(fn, "__code__", None)
    scope = getattr(fn, "__globals__", None)
    if isinstance(code, types.CodeType) and isinstance(scope, dict):
        for name in dict.fromkeys(_code_names(code)):
            if name in scope:
                yield name, scope[name]
    for i, cell in enumerate(getattr(fn, "__closure__", None) or ()):
        try:
            yield f"<closure {i}>", cell.cell_contents
        except ValueError:  # an empty cell: a variable not bound yet
            continue


#: Plain data a step's own module may define and its code name: folded by value (``repr``), not by file.
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
#: A constant container larger than this is not folded by value: the whole module file is, instead.
_PLAIN_ITEMS = 1000


def _plain(value: Any, budget: list[int]) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v, budget) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, budget) and _plain(v, budget) for k, v in value.items())
    return False


def _own_module_digest(fn: Callable[..., Any], walk: _Walk) -> str | None:
    """What the step reaches of its OWN module, folded alone: the source of every function and class of that
    module its code names (transitively), and the value of every plain constant it names. Editing an unrelated
    function or constant of the same file then rebuilds nothing; editing one the step reaches rebuilds it.
    Everything named from other modules goes to ``walk``. None when something of the own module cannot be folded
    by itself (an object, a large constant, source that cannot be read): the whole file is folded then."""
    home = getattr(fn, "__module__", None)
    parts: list[str] = []
    seen: set[int] = {id(fn)}
    stack: list[Any] = [fn]
    while stack:
        current = stack.pop()
        for name, value in _named_values(current):
            if isinstance(value, types.ModuleType):
                walk.reach_value(value)
                continue
            owner = (
                getattr(value, "__module__", None)
                if (inspect.isfunction(value) or inspect.isclass(value))
                else None
            )
            if owner == home and owner is not None:
                if id(value) in seen:
                    continue
                seen.add(id(value))
                try:
                    parts.append(f"def {value.__qualname__}\n{inspect.getsource(value)}")
                except (OSError, TypeError):
                    return None
                if inspect.isclass(value):
                    stack.extend(v for v in vars(value).values() if inspect.isfunction(v))
                else:
                    stack.append(value)
            elif (
                owner is None
                and _plain(value, [_PLAIN_ITEMS])
                and getattr(current, "__module__", None) == home
            ):
                parts.append(f"const {name} = {value!r}")
            elif owner is None and getattr(type(value), "__module__", None) == home:
                return None  # an instance of the own module's class: its state is not in any source line
            else:
                walk.reach_value(value)
    return hashlib.sha256("\n".join(sorted(parts)).encode("utf-8")).hexdigest()


# -- files: digest and imports, memoised ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Import:
    """One import statement: ``level`` dots, the ``module`` after them, the ``names`` a ``from`` import takes."""

    level: int
    module: str | None
    names: tuple[str, ...]


@dataclass(frozen=True)
class _FileFacts:
    stat: tuple[int, int, int, int]
    digest: str
    imports: tuple[_Import, ...]
    trusted: bool


_FILES: dict[str, _FileFacts] = {}
_PARSED: dict[str, tuple[_Import, ...]] = {}
_DYNAMIC_IMPORTS = frozenset({"import_module", "__import__"})


def _file_facts(path: str) -> _FileFacts | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    sig = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)
    known = _FILES.get(path)
    if known is not None and known.trusted and known.stat == sig:
        return known
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    digest = hashlib.sha256(data).hexdigest()
    imports = _PARSED.get(digest)
    if imports is None:
        imports = _imports_of(data) if path.endswith((".py", ".pyw")) else ()
        if len(_PARSED) >= _PARSE_CAP:
            _PARSED.clear()
        _PARSED[digest] = imports
    trusted = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS
    facts = _FileFacts(sig, digest, imports, trusted)
    _FILES[path] = facts
    return facts


def _imports_of(source: bytes) -> tuple[_Import, ...]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ()  # a module Python cannot compile cannot be imported either
    found: list[_Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [_Import(0, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(_Import(node.level or 0, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
                found.append(_Import(0, first.value, ()))  # importlib.import_module("pkg.mod") spelled out
    return tuple(found)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in _DYNAMIC_IMPORTS
    return isinstance(func, ast.Attribute) and func.attr in _DYNAMIC_IMPORTS


# -- names: where their code lives, never importing -------------------------------------------------------------

_Located = tuple[str | None, tuple[str, ...] | None]  # (origin file, submodule search locations)
_SPECS: dict[str, _Located | None] = {}
_SPECS_PATH: list[tuple[str, ...]] = [()]
_SPECS_LOCK = threading.Lock()


def _locate(name: str) -> _Located | None:
    """Where module ``name``'s code lives: the loaded module's, else the spec ``PathFinder`` finds for it (its
    parents' specs found the same way), else None. Nothing is imported."""
    mod = sys.modules.get(name)
    if mod is not None:
        path = getattr(mod, "__path__", None)
        return _origin(mod), (tuple(path) if path is not None else None)
    with _SPECS_LOCK:
        snapshot = tuple(sys.path)
        if _SPECS_PATH[0] != snapshot:
            _SPECS.clear()
            _SPECS_PATH[0] = snapshot
        if name in _SPECS:
            return _SPECS[name]
    parent = name.rpartition(".")[0]
    search: list[str] | None = None
    if parent:
        above = _locate(parent)
        if above is None or above[1] is None:
            return None
        search = list(above[1])
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, search)
    except (ImportError, ValueError, OSError):
        spec = None
    located: _Located | None = None
    if spec is not None:
        origin = spec.origin if spec.has_location else None
        locations = spec.submodule_search_locations
        located = (origin, tuple(locations) if locations is not None else None)
    with _SPECS_LOCK:
        _SPECS[name] = located
    return located


def _origin(mod: Any) -> str | None:
    file = getattr(mod, "__file__", None)
    if isinstance(file, str):
        return file
    spec = getattr(mod, "__spec__", None)
    origin = getattr(spec, "origin", None)
    return origin if isinstance(origin, str) and getattr(spec, "has_location", False) else None


# -- the walk -------------------------------------------------------------------------------------------------


class _Walk:
    """One step's walk: project modules by name → digest, the top-level names of the installed ones reached."""

    def __init__(self, identity: str, roots: tuple[str, ...], max_modules: int) -> None:
        self.identity = identity
        self.roots = roots
        self.max_modules = max_modules
        self.seen: set[str] = set()
        self.counted = 0
        self.project: set[str] = set()
        self.modules: dict[str, str] = {}
        self.outside: set[str] = set()
        self.pending: list[tuple[str, str]] = []

    def reach(self, name: str, origin: str | None) -> None:
        if not name or name in self.seen:
            return
        self.seen.add(name)
        top = name.partition(".")[0]
        if top == _SELF_TOP or _placeholder(top):
            return
        real = None if origin is None else _real(origin)
        if _stdlib(top, real):
            return
        self.counted += 1
        if self.counted > self.max_modules:
            raise CacheError(
                "key_uncomputable",
                f"step {self.identity}: its code reaches more than {self.max_modules} modules (reaching {name}); "
                "a step's key folds every module it reaches, so this is refused rather than keyed by less. Check "
                f"that its project roots ({', '.join(self.roots)}) hold only the project's code, not a home "
                "directory or a tree of many projects, or define the step in a module that imports less",
                step=self.identity,
                max_modules=self.max_modules,
                module=name,
            )
        if real is not None and any(_under(real, r) for r in self.roots) and not _installed(real):
            self.project.add(name)
            self.pending.append((name, real))
        else:
            self.outside.add(top)

    def reach_name(self, name: str) -> None:
        if name in self.seen:
            return
        located = _locate(name)
        self.reach(name, None if located is None else located[0])

    def reach_value(self, value: Any) -> None:
        if isinstance(value, types.ModuleType):
            name = _module_name(value)
            if name is not None:
                self.reach(name, _origin(value))
            return
        # Functions, classes and wrappers (functools.wraps, Prefect tasks and flows) say where their code lives;
        # other objects, by their type.
        try:
            owners = (getattr(value, "__module__", None), getattr(type(value), "__module__", None))
        except Exception:  # a proxy whose attribute lookup fails says nothing about where code lives
            return
        for owner in owners:
            if isinstance(owner, str) and owner not in self.seen:
                mod = sys.modules.get(owner)
                name = _module_name(mod) if mod is not None else owner
                if name is not None:
                    self.reach(name, None if mod is None else _origin(mod))

    def drain(self) -> None:
        while self.pending:
            name, path = self.pending.pop()
            facts = _file_facts(path)
            if facts is None:
                continue
            self.modules[name] = facts.digest
            package = name if os.path.basename(path).startswith("__init__.") else name.rpartition(".")[0]
            for imp in facts.imports:
                self._follow(imp, package)

    def _project_namespace(self, name: str) -> bool:
        located = _locate(name)
        if located is None or located[0] is not None or not located[1]:
            return False
        return any(
            any(_under(_real(d), r) for r in self.roots) and not _installed(_real(d)) for d in located[1]
        )

    def _follow(self, imp: _Import, package: str) -> None:
        if imp.level:
            bits = package.split(".") if package else []
            if imp.level - 1 >= len(bits):
                return  # beyond the top-level package: Python refuses it too
            base = ".".join(bits[: len(bits) - imp.level + 1])
            if imp.module:
                base = f"{base}.{imp.module}"
        elif imp.module:
            base = imp.module
        else:
            return
        parts = base.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b too
            self.reach_name(".".join(parts[:i]))
        if base not in self.project and not self._project_namespace(base):
            return  # an installed package is folded by its version, whatever it exports
        for taken in imp.names:
            sub = f"{base}.{taken}"
            if taken != "*" and sub not in self.seen and _locate(sub) is not None:
                self.reach_name(sub)  # `from pkg import mod` takes a submodule


# -- distributions --------------------------------------------------------------------------------------------


@functools.cache
def _packages() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _distributions(
    tops: Iterable[str], packages: Mapping[str, Sequence[str]] | None, versions: Mapping[str, str] | None
) -> tuple[tuple[str, str], ...]:
    wanted = sorted(tops)
    if not wanted:
        return ()  # the process-wide index costs a walk over every installed distribution: only when needed
    providers = _packages() if packages is None else packages
    found: dict[str, str] = {}
    for top in wanted:
        for dist in providers.get(top, ()):
            version = _version(dist) if versions is None else versions.get(dist)
            if version is not None:
                found[dist] = version
    return tuple(sorted(found.items()))
