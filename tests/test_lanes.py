"""The fast lane's list of slow tests (tests/conftest.py) names tests that exist: a renamed file or
test would otherwise drop out of the list silently and slow the fast lane down again; and the
files with slow tests are handed to the xdist workers first."""
import ast
from pathlib import Path

import conftest

TESTS = Path(__file__).resolve().parent


def _functions(name: str) -> set[str]:
    tree = ast.parse((TESTS / name).read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_slow_file_and_test_exists_and_says_why():
    assert [name for name in conftest.SLOW_FILES if not (TESTS / name).is_file()] == []
    missing = [key for key in conftest.SLOW_TESTS
               if not (TESTS / key.split("::")[0]).is_file() or key.split("::")[1] not in _functions(key.split("::")[0])]
    assert missing == []
    assert all(reason.strip() for reason in (*conftest.SLOW_FILES.values(), *conftest.SLOW_TESTS.values(),
                                             *conftest.SLOW_PREFIXES.values()))
    assert list(TESTS.glob("test_bench_*.py"))  # the lab's tests the prefix marks


def test_files_with_slow_tests_are_handed_out_first_each_in_its_order():
    from types import SimpleNamespace

    def item(path, name, slow=False):
        return SimpleNamespace(path=Path(path), name=name, keywords={"slow": True} if slow else {})

    items = [item("a.py", "a1"), item("b.py", "b1"), item("b.py", "b2", slow=True), item("c.py", "c1"),
             item("d.py", "d1", slow=True), item("d.py", "d2")]
    conftest.slow_files_first(items)
    assert [i.name for i in items] == ["b1", "b2", "d1", "d2", "a1", "c1"]
