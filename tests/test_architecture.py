"""The folders show the pipeline, and the imports keep to it.

Read from the source with ``ast`` (nothing is imported): every import of every module of
``parity/`` and ``kernels/`` (installed as ``parity.kernels``), at module level or inside a
function. The stages, lowest first::

    parity.kernels  <  base  <  bundle  <  run  <  judge  <  report  <  speed, distributed  <  cli  <  testing

A module may import from its own stage and from the stages below it, never from one above; the
kernel layer imports nothing of the harness. No two modules import each other, directly or
through others. No module imports another module's private ``_name``. An import inside a function
(a late import) is allowed only where :data:`LATE_IMPORTS` lists it with its reason: an optional
dependency, or start-up time.
"""
from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Stage of each top-level room of parity/ (parity.kernels is kernels/). Equal numbers may import
# each other's modules (no cycle all the same).
STAGES = {
    "kernels": 0,
    "base": 1,
    "bundle": 2,
    "run": 3,
    "judge": 4,
    "report": 5,
    "speed": 6,
    "distributed": 6,
    "cli": 7,
    "testing": 8,
    "integrations": 8,  # a user-facing face: the kernel as a transformers attention
    "__init__": 9,  # the public API, lazily (module __getattr__)
    "__main__": 9,
}

# Imports that break the rules on purpose, each with its reason.
EXEMPT_MODULES: dict[str, str] = {}

# Late imports: (module pattern, imported pattern) -> why the import waits until it is needed.
# fnmatch patterns over dotted names; a relative import is resolved first.
LATE_IMPORTS = {
    ("*", "triton*"): "optional dependency (the [triton] extra); also chosen after TRITON_INTERPRET is set",
    ("*", "transformers*"): "optional dependency (the [transformers] extra)",
    ("parity.speed.clocks", "pynvml"): "optional dependency (nvidia-ml-py): the clock and throttle reasons, where installed",
    ("parity.speed.clocks", "amdsmi"): "optional dependency (ROCm's amdsmi): the clock and throttle status, where installed",
    ("parity.run.subjects.*", "parity.kernels*"): "Triton is imported only after the interpreter is chosen "
                                                  "(runtime.enable_triton_interpreter), by the impls that use it",
    ("parity.run.fuzz", "parity.kernels*"): "Triton is imported only after the interpreter is chosen",
    ("parity.integrations.*", "parity.kernels*"): "registering the attention imports no Triton",
    ("parity.kernels", "importlib.*"): "only when this folder is imported as a top-level `kernels` (the hand-over "
                                       "to an installed package of that name)",
    ("parity.kernels.launch", "inspect"): "read with the Triton kernel whose parameters it lists, which is loaded "
                                          "only after TRITON_INTERPRET is chosen",
    ("parity.kernels.aot", "*"): "each compile runs in a child process (python -m parity.kernels.aot) that "
                                 "imports what its step needs",
    ("parity.kernels.*", "parity.kernels.triton_attention"): "the @triton.jit kernels are defined only after "
                                                             "TRITON_INTERPRET is chosen",
    ("parity.testing.plugin", "_pytest.junitxml"): "pytest's private JUnit helper, only when --junit-xml is given",
    ("parity.distributed.*", "torch.distributed*"): "torch.distributed and DTensor (which loads dynamo) only when a "
                                                   "process group is joined or a DTensor output is seen",
}

# Modules whose start-up time matters: a late import there is allowed where what it imports is
# heavy (torch, Triton, numpy, safetensors, or a module that imports one at load).
START_UP_TIME = {
    "parity.cli.*": "`parity --help` and a bad argument answer at once, without importing torch",
    "parity.testing.*": "the pytest plugin loads in every pytest run of the environment",
}
HEAVY = ("torch", "triton", "numpy", "safetensors", "transformers", "hypothesis")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "parity").rglob("*.py")):
        parts = path.relative_to(REPO / "parity").with_suffix("").parts
        found[".".join(("parity",) + parts).removesuffix(".__init__")] = path
    for path in sorted((REPO / "kernels").rglob("*.py")):
        parts = path.relative_to(REPO / "kernels").with_suffix("").parts
        found[".".join(("parity", "kernels") + parts).removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _stage(module: str) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else "__init__"
    if len(parts) == 2 and module in ("parity.__init__", "parity.__main__"):
        room = parts[1]
    return STAGES[room]


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path):
    """(imported module, names, line, late) for every import of ``module``; a name imported from
    a package that is one of its modules counts as that module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    found = []

    def visit(node, late):
        for child in ast.iter_child_nodes(node):
            inner = late or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, (), child.lineno, late))
            elif isinstance(child, ast.ImportFrom):
                target = _absolute(module, child, is_package)
                names = tuple(alias.name for alias in child.names)
                submodules = [name for name in names if f"{target}.{name}" in MODULES]
                for name in submodules:
                    found.append((f"{target}.{name}", (), child.lineno, late))
                rest = tuple(name for name in names if name not in submodules)
                if rest or not submodules:
                    found.append((target, rest, child.lineno, late))
            visit(child, inner)

    visit(tree, False)
    return found


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def _internal(target: str) -> str | None:
    """The module of this tree that ``target`` names (a package counts as its __init__), or None."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def test_the_rooms_are_the_stages():
    rooms = {path.name for path in (REPO / "parity").iterdir()
             if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py"}
    assert rooms - {"__init__.py", "__main__.py"} <= {name for name in STAGES}
    for room in ("base", "bundle", "run", "judge", "report", "cli", "testing"):
        package = REPO / "parity" / room / "__init__.py"
        assert ast.get_docstring(ast.parse(package.read_text())), f"{room} has no docstring saying what it owns"


def test_every_module_says_what_it_owns():
    missing = [module for module, path in MODULES.items()
               if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
    assert missing == []


def test_no_module_imports_from_a_higher_stage():
    upward = []
    for module, imports in IMPORTS.items():
        if module in EXEMPT_MODULES:
            continue
        for target, names, line, _ in imports:
            internal = _internal(target) if target.startswith("parity") else None
            if internal == "parity" and names == ("__version__",):
                continue  # the package's version: a constant of parity/__init__.py, which imports nothing
            if internal is not None and _stage(internal) > _stage(module):
                upward.append(f"{module}:{line} imports {internal}")
    assert upward == []


def test_the_kernel_layer_imports_torch_and_triton_only():
    outside = []
    for module, imports in IMPORTS.items():
        if not module.startswith("parity.kernels") or module in EXEMPT_MODULES:
            continue
        for target, _, line, _ in imports:
            if target.startswith("parity") and not target.startswith("parity.kernels"):
                outside.append(f"{module}:{line} imports {target}")
    assert outside == []


def test_nothing_installed_imports_the_lab():
    """bench/ (the benchmarks, probes and device scripts) is not in the wheel: an import of it from
    the package would work in a checkout and fail once installed."""
    into_the_lab = [f"{module}:{line} imports {target}" for module, imports in IMPORTS.items()
                    for target, _, line, _ in imports if target == "bench" or target.startswith("bench.")]
    assert into_the_lab == []


def test_the_naive_reference_needs_nothing_but_torch():
    imported = {target for target, _, _, _ in IMPORTS["parity.kernels.reference"]}
    allowed = {"__future__", "math", "torch", "parity.kernels.layout", "parity.kernels.inputs",
               "parity.kernels.dtypes"}
    assert imported <= allowed, imported - allowed
    for helper in imported & {"parity.kernels.layout", "parity.kernels.inputs", "parity.kernels.dtypes"}:
        for target, _, _, _ in IMPORTS[helper]:
            assert target.split(".")[0] in ("__future__", "torch", "collections", "dataclasses", "math",
                                            "typing", "parity"), (helper, target)
            assert not target.startswith("parity") or target in allowed, (helper, target)


def test_no_import_cycle_between_modules():
    graph = {module: {_internal(target) for target, _, _, _ in imports if target.startswith("parity")}
             - {None, module} for module, imports in IMPORTS.items()}
    # A package's __init__ that only documents its modules is no node of a cycle.
    cycles, state, stack = [], {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []


def test_no_private_name_is_imported_from_another_module():
    private = []
    for module, imports in IMPORTS.items():
        for target, names, line, _ in imports:
            if not target.startswith("parity") or target == module:
                continue
            private += [f"{module}:{line} imports {target}.{name}" for name in names
                        if name.startswith("_") and not name.startswith("__")]
    assert private == []


def _heavy(target: str, seen=None) -> bool:
    """Whether importing ``target`` loads a heavy library (:data:`HEAVY`), at module level."""
    if target.split(".")[0] in HEAVY:
        return True
    internal = _internal(target) if target.startswith("parity") else None
    if internal is None:
        return False
    seen = set() if seen is None else seen
    if internal in seen:
        return False
    seen.add(internal)
    return any(_heavy(name, seen) for name, _, _, late in IMPORTS[internal] if not late)


def _late_rule(module: str, target: str):
    for (where, what), reason in LATE_IMPORTS.items():
        if fnmatch.fnmatchcase(module, where) and fnmatch.fnmatchcase(target, what):
            return where, what
    for where in START_UP_TIME:
        if fnmatch.fnmatchcase(module, where) and _heavy(target):
            return where
    return None


def test_late_imports_only_where_listed_with_their_reason():
    unlisted, used = [], set()
    for module, imports in IMPORTS.items():
        for target, _, line, late in imports:
            if not late:
                continue
            rule = _late_rule(module, target)
            if rule is None:
                unlisted.append(f"{module}:{line} imports {target}")
            else:
                used.add(rule)
    assert unlisted == []
    assert set(LATE_IMPORTS) - used == set(), "rules that no late import needs any more"
    assert set(START_UP_TIME) - used == set(), "rules that no late import needs any more"
    assert all(reason.strip() for reason in (*LATE_IMPORTS.values(), *START_UP_TIME.values()))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("parity.kernels")))
def test_no_module_is_over_600_lines_without_its_reason(module):
    path = MODULES[module]
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if lines > 650:
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        assert "Long because" in docstring, f"{path.relative_to(REPO)}: {lines} lines and no reason given"


def test_the_public_api_is_listed_once_and_import_parity_stays_cheap():
    code = ("import sys, parity; print(sorted(m for m in ('torch', 'triton', 'parity.run', 'parity.judge') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    import parity
    from parity.judge.compare import compare_bundle
    from parity.judge.diff import diff_bundles
    from parity.run.capture import capture
    from parity.run.subjects.base import Inputs, Subject
    from parity.testing.goldens import ParityFailure, assert_parity, check_parity

    assert (parity.capture, parity.compare_bundle, parity.diff_bundles) == (capture, compare_bundle, diff_bundles)
    assert (parity.check_parity, parity.assert_parity, parity.ParityFailure) == (check_parity, assert_parity,
                                                                                 ParityFailure)
    assert (parity.Subject, parity.Inputs) == (Subject, Inputs)
    assert parity.kernels.__name__ == "parity.kernels" and callable(parity.kernels.block_sparse_attention)
    with pytest.raises(AttributeError, match="no attribute 'compare'"):
        parity.compare  # noqa: B018  (the deprecated module-level names are gone)
