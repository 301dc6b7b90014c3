"""Where Python would load a dotted module and each of its parent packages from, found without importing any of them.

``import a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` before ``c``; the trust check
(:mod:`parity.run.subjects.base`) must know every one of those files before any runs, so that a
subject spec whose module, or any parent package (a regular one's ``__init__`` or a namespace
package's directories), lies inside a bundle is refused before anything executes.

``importlib.util.find_spec("a.b.c")`` cannot be used: it imports ``a`` and ``a.b`` to read their
``__path__``. :func:`module_locations` follows the import system level by level instead, giving
each level the search path found for its parent: a level already in ``sys.modules`` is where it
was loaded from; otherwise ``sys.meta_path`` is asked in order, as ``import`` asks it, with the
path-based finder replaced by the same search done through ``sys.path_importer_cache`` /
``sys.path_hooks`` and each entry's ``find_spec`` (the public parts of ``PathFinder``): building
the namespace spec ``PathFinder.find_spec`` returns needs the parent already imported.
"""
from __future__ import annotations

import importlib.machinery
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnresolvedModule(Exception):
    """A level whose location could not be worked out without importing something (a finder raised)."""


@dataclass(frozen=True)
class ModuleLocation:
    """One level of a dotted name: ``name`` (``a.b``), the files and directories it would be loaded
    from (a module's file, a package's directories), and whether it is already loaded."""

    name: str
    places: tuple[Path, ...]
    loaded: bool


def module_locations(module_name: str) -> list[ModuleLocation]:
    """Every level of ``module_name`` that can be found, outermost first, with where it would be
    loaded from; stops at the first level that cannot be found (the import then raises
    ImportError). Imports nothing and runs no module's code. Raises :class:`UnresolvedModule`
    when a finder raised."""
    locations: list[ModuleLocation] = []
    search_path: list[str] | None = None  # None: sys.path, for the top level
    parent_is_package = True
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = sys.modules.get(name)
        if module is not None:  # ``import`` takes it as it is (``os.path`` too, though os is no package)
            package_path = getattr(module, "__path__", None)
            locations.append(ModuleLocation(name, _loaded_places(module), True))
        elif not parent_is_package:
            break  # a deeper level cannot be imported from a module that is not a package
        else:
            found = _find(name, search_path)
            if found is None:
                break
            places, package_path = found
            locations.append(ModuleLocation(name, places, False))
        parent_is_package = package_path is not None
        search_path = [entry for entry in list(package_path or []) if isinstance(entry, str)]
    return locations


def _resolved(path: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return Path(os.path.abspath(path))


def _loaded_places(module: Any) -> tuple[Path, ...]:
    places = []
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        places.append(_resolved(file))
    for entry in list(getattr(module, "__path__", None) or []):
        if isinstance(entry, str):
            places.append(_resolved(entry))
    return tuple(places)


def _find(name: str, search_path: list[str] | None) -> tuple[tuple[Path, ...], list[str] | None] | None:
    """``(places, package search path or None)`` of the spec ``import`` would use for ``name``."""
    for finder in sys.meta_path:
        try:
            if finder is importlib.machinery.PathFinder:
                found = _path_based(name, sys.path if search_path is None else search_path)
            else:
                find_spec = getattr(finder, "find_spec", None)
                spec = None if find_spec is None else find_spec(name, search_path)
                found = None if spec is None else _spec_places(spec)
        except Exception as err:  # noqa: BLE001 - a finder's own failure: no location can be vouched for
            raise UnresolvedModule(f"{type(finder).__name__}.find_spec({name!r}) raised "
                                   f"{type(err).__name__}: {' '.join(str(err).split())}") from None
        if found is not None:
            return found
    return None


def _spec_places(spec: importlib.machinery.ModuleSpec) -> tuple[tuple[Path, ...], list[str] | None]:
    places = []
    if spec.origin and spec.has_location:
        places.append(_resolved(spec.origin))
    locations = spec.submodule_search_locations
    package_path = None if locations is None else [entry for entry in list(locations) if isinstance(entry, str)]
    places.extend(_resolved(entry) for entry in package_path or [])
    return tuple(places), package_path


def _path_based(name: str, search_path: list[str]) -> tuple[tuple[Path, ...], list[str] | None] | None:
    """The path-based finder's search: the first entry with a module or regular package wins;
    directories without ``__init__`` on the way are portions of a namespace package, used only
    when nothing else is found (PEP 420)."""
    portions: list[str] = []
    for entry in search_path:
        if not isinstance(entry, str):
            continue
        finder = _entry_finder(entry or os.getcwd())
        if finder is None or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name)
        if spec is None:
            continue
        if spec.loader is not None:
            return _spec_places(spec)
        portions.extend(location for location in spec.submodule_search_locations or [] if isinstance(location, str))
    if portions:
        return tuple(_resolved(portion) for portion in portions), portions
    return None


def _entry_finder(entry: str) -> Any:
    """The finder for one search-path entry: the cached one, else the first path hook that takes
    it (not cached: this lookup leaves the import system as it was)."""
    if entry in sys.path_importer_cache:
        return sys.path_importer_cache[entry]
    for hook in sys.path_hooks:
        try:
            return hook(entry)
        except ImportError:
            continue
    return None
