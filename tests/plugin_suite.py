"""A two-test suite for pytester runs of the plugin: ``test_pair`` checks a recorded tensor golden
(broken by ``BREAK=1``: one element off by 0.5), ``test_plain`` checks nothing."""
import torch

TESTS = '''
import os

import torch

X = torch.linspace(-1, 1, 1000).reshape(10, 100)


def test_pair(parity_check):
    y = X.clone()
    if os.environ.get("BREAK"):
        y[3, 7] += 0.5
    parity_check({"out": y, "lse": X[:, 0].clone()}, name="pair")


def test_plain():
    assert True
'''


def make_plugin_suite(pytester):
    """Write the suite into ``pytester`` and record the golden ``pair`` it checks; returns pytester."""
    from parity.testing.goldens import check_parity

    pytester.makepyfile(test_suite=TESTS)
    x = torch.linspace(-1, 1, 1000).reshape(10, 100)
    check_parity("pair", {"out": x, "lse": x[:, 0].clone()}, golden_dir=pytester.path / "goldens", record=True)
    return pytester
