"""More than one seed: ``capture --seeds N`` records N input draws, compare judges each tensor on its worst.

Known answers from ``tests/repeat_subject.py``: impl ``clipped`` equals the reference exactly for a
draw whose values reaching ``mix`` stay within CLIP, and is wrong for one that exceeds it.
:func:`repeat_subject.draw_exceeds_clip` answers that from the inputs alone, so the failing seeds
are known without running the implementation under test. The seeds are the subject's own
``seed`` argument and the ones after it, fixed before anything runs.
"""
from __future__ import annotations

import json
import shutil

import pytest

import parity.cli.main
from parity.base.errors import BundleError, UsageError
from parity.bundle.manifest import SCHEMA_VERSION, SEEDS_VERSION
from parity.bundle.reader import open_bundle
from parity.bundle.writer import edit_manifest
from parity.run.seeds import draw_views, seed_values
from repeat_subject import draw_exceeds_clip
from test_report_json_schemas import cli as run, validate  # the CLI in process: (status, out, err)

SUBJECT = "repeat_subject:make_subject"
BASE_SEED, COUNT = 3, 3
pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    path = tmp_path_factory.mktemp("seeds") / "draws"
    assert parity.cli.main.main(["capture", "--subject", SUBJECT, "--bundle", str(path), "--set", f"seed={BASE_SEED}",
                                 "--seeds", str(COUNT), "--quiet"]) == 0
    return path


def test_seed_values_are_the_subjects_seed_and_the_ones_after_it():
    assert seed_values({"seed": 7}, 3, "s") == [7, 8, 9]
    assert seed_values({"seed": 7}, 1, "s") == []  # one draw: the bundle as always
    with pytest.raises(UsageError, match="takes an integer 'seed' argument; subject s has none"):
        seed_values({}, 2, "s")
    with pytest.raises(UsageError, match="attention cases carry their own seeds"):
        seed_values({"cases": "smoke"}, 2, "attention")


def test_the_draws_are_stored_as_one_bundle_of_schema_6(drawn):
    bundle = open_bundle(drawn)
    assert bundle.schema_version == SEEDS_VERSION
    assert bundle.seeds["values"] == [3, 4, 5] and len(bundle.seeds["inputs_meta"]) == 2
    # The first draw is the bundle as always; each later one has its own inputs, outputs and references.
    assert [entry.name for entry in bundle.entries_of("output")] == ["pre", "mix", "post", "<root>"]
    assert [entry.name for entry in bundle.entries_of("draw_output")][:4] == ["4|pre", "4|mix", "4|post", "4|<root>"]
    assert len(bundle.entries_of("draw_reference")) == 8 and len(bundle.entries_of("draw_input")) == 2
    assert bundle.verify() == len(bundle.entries)
    views = draw_views(bundle)
    assert [view.seed for view in views] == [4, 5]
    first, later = bundle.tensors("input")["x"], views[0].tensors("input")["x"]
    assert first.shape == later.shape and not first.equal(later)


def test_one_seed_writes_the_bundle_as_before(tmp_path):
    code = parity.cli.main.main(["capture", "--subject", SUBJECT, "--bundle", str(tmp_path / "one"), "--seeds", "1",
                                 "--quiet"])
    bundle = open_bundle(tmp_path / "one")
    assert code == 0 and bundle.schema_version == SCHEMA_VERSION and bundle.seeds is None


def _compare(capsys, bundle, tmp_path, impl):
    paths = {name: tmp_path / f"{impl}.{name}" for name in ("json", "html", "xml")}
    code, out, err = run(capsys, "compare", "--bundle", str(bundle), "--subject", SUBJECT, "--impl", impl, "--quiet",
                         "--json", str(paths["json"]), "--html", str(paths["html"]), "--junit-xml", str(paths["xml"]))
    return code, out, json.loads(paths["json"].read_text()), paths


def test_an_impl_wrong_for_some_draws_fails_on_those_seeds_only(capsys, drawn, tmp_path):
    values = list(range(BASE_SEED, BASE_SEED + COUNT))
    expected_failing = [seed for seed in values if draw_exceeds_clip(seed)]
    # The draws are a meaningful test only if some fail and some pass: known before running it.
    assert 0 < len(expected_failing) < COUNT and BASE_SEED not in expected_failing
    code, out, report, paths = _compare(capsys, drawn, tmp_path, "clipped")
    assert code == 1 and not report["passed"]
    seeds = validate(report)["seeds"]
    assert seeds["count"] == COUNT and seeds["values"] == values and seeds["failing_seeds"] == expected_failing
    rows = {row["name"]: row for row in seeds["tensors"]}
    assert rows["pre"]["failing_seeds"] == [] and rows["pre"]["rel_l2"]["worst"] == 0.0
    assert rows["mix"]["failing_seeds"] == expected_failing and rows["mix"]["worst_seed"] in expected_failing
    # Two of the three draws are exact: the median is 0, the worst is the clipped draw's error.
    assert rows["mix"]["rel_l2"]["median"] == 0.0 and rows["mix"]["rel_l2"]["worst"] > 1e-3
    # The table and the verdict are the worst draw's: mix fails, although the first draw passes.
    layers = {layer["name"]: layer for layer in report["layers"]}
    assert not layers["mix"]["passed"] and layers["pre"]["passed"]
    assert report["verdict"] == ("PARITY FAILS: first failing tensor mix (3 of 4 tensors fail) "
                                 f"[{COUNT} seeds, judged on the worst]")
    assert f"seeds: every verdict rests on {COUNT} input draws (seeds 3, 4, 5)" in out
    assert '<section id="seeds">' in paths["html"].read_text()
    assert 'name="seeds" value="seeds: every verdict rests on 3 input draws' in paths["xml"].read_text()


def test_a_correct_impl_holds_on_every_seed(capsys, drawn, tmp_path):
    code, out, report, _ = _compare(capsys, drawn, tmp_path, "reference")
    assert code == 0 and report["seeds"]["failing_seeds"] == []
    assert report["verdict"] == f"PARITY HOLDS: 4/4 tensors [{COUNT} seeds, judged on the worst]"


def test_a_damaged_seeds_field_is_a_bundle_error(drawn, tmp_path):


    copy = tmp_path / "copy"
    shutil.copytree(drawn, copy)
    edit_manifest(copy, lambda manifest: manifest["seeds"].update(values=[3, 3, 5]))
    with pytest.raises(BundleError, match="seeds.values.*lists a seed twice"):
        open_bundle(copy)
    edit_manifest(copy, lambda manifest: manifest.pop("seeds"))  # 2 draws x (1 input, 4 outputs, 4 references)
    with pytest.raises(BundleError, match="seeds.*missing, but the bundle holds 18 draw_\\* entries"):
        open_bundle(copy)


@pytest.mark.parametrize("value", ["0", "-1", "x", "2.5"])
def test_a_bad_seed_count_is_one_line_and_exit_2(capsys, tmp_path, value):
    code, _, err = run(capsys, "capture", "--subject", SUBJECT, "--bundle", str(tmp_path / "b"), "--seeds", value)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--seeds" in err and not (tmp_path / "b").exists()


def test_seeds_need_a_subject_with_a_seed(capsys, tmp_path):
    code, _, err = run(capsys, "capture", "--subject", "attention", "--bundle", str(tmp_path / "b"), "--seeds", "2",
                       "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "attention cases carry their own seeds" in err
    assert not (tmp_path / "b").exists()


def test_builtin_decoder_records_and_judges_several_draws(capsys, tmp_path):
    small = ["--set", "layers=1", "--set", "d_model=64", "--set", "seq_len=64", "--set", "batch=1",
             "--set", 'layer_layouts=["causal"]']
    code, _, err = run(capsys, "capture", "--subject", "decoder", "--bundle", str(tmp_path / "dec"), "--seeds", "2",
                       "--quiet", *small)
    assert code == 0, err
    code, out, err = run(capsys, "compare", "--bundle", str(tmp_path / "dec"), "--impl", "reference", "--quiet")
    assert code == 0, err
    assert "[2 seeds, judged on the worst]" in out.splitlines()[-1]


def test_plugin_records_several_seeds_and_fails_on_the_bad_draw(pytester):
    pytester.makepyfile(test_seeds=f'''
        import pytest

        @pytest.mark.parity(golden="draws", subject={SUBJECT!r}, args={{"seed": {BASE_SEED}}})
        def test_clipped(parity_check):
            parity_check.subject(impl="clipped")

        @pytest.mark.parity(golden="draws", subject={SUBJECT!r}, args={{"seed": {BASE_SEED}}})
        def test_reference(parity_check):
            parity_check.subject(impl="reference")
    ''')
    pytester.runpytest("--parity-seeds", str(COUNT), "-p", "no:cacheprovider", "-k", "reference")  # records
    assert open_bundle(pytester.path / "goldens" / "draws").seeds["values"] == [3, 4, 5]
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*seeds: every verdict rests on 3 input draws (seeds 3, 4, 5)*failing on seed(s) 4*"])
