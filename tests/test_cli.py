"""The CLI's conventions: --version, one spelling (metavar, help) per shared flag across commands with
the old spellings still parsing, defaults in help, --device auto, '-' as standard output, a table that
fits 120 columns unless --wide, Markdown-safe names, --html, and failure reasons and "would pass
with" values that tell the numbers apart and load."""
import argparse
import html.parser
import json
import math
import re
from importlib import metadata

import pytest
import torch
from torch import nn

import parity
import parity.cli.main
from parity.cli import options
from parity.run.capture import capture
from parity.judge.engine import compare_tensors
from parity.judge.policy import Policy, Tolerance
from parity.report.text import markdown_escape, shorten_name
from parity.judge.results import unrelaxable_checks, would_pass_text
from parity.run.subjects import Inputs, Subject, trusting
from parity.run.subjects.attention import CASE_SETS


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


@pytest.fixture(scope="module")
def commands():
    return _subparsers(parity.cli.main.build_parser())


def run(capsys, *argv):
    code = parity.cli.main.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- --version -----------------------------------------------------------------------------------


def test_version_prints_the_installed_version(capsys):
    code, out, err = run(capsys, "--version")
    assert code == 0 and err == ""
    assert out == f"parity {metadata.version('parity')}\n"


def test_version_falls_back_to_the_package_attribute(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert parity.cli.main.version() == parity.__version__


def test_main_builds_its_parser_once_and_hands_each_call_its_own_default_lists(monkeypatch, capsys):
    """main() parses with one parser a process (building one costs milliseconds a call); a default
    list (inspect's ``--set``) reaches each call as a copy, so a command changing it cannot change
    the next call's default."""
    built, seen = [], []
    original = parity.cli.main.build_parser

    def recording_parser():
        parser = original()
        _subparsers(parser)["inspect"].set_defaults(func=lambda args: seen.append(args) or 0)
        built.append(parser)
        return parser

    monkeypatch.setattr(parity.cli.main, "build_parser", recording_parser)
    parity.cli.main._shared_parser.cache_clear()
    try:
        assert run(capsys, "inspect") == (0, "", "") and run(capsys, "inspect", "--set", "num_warps=4")[0] == 0
        seen[0].overrides.append("num_warps=8")  # a command that changes its list
        assert run(capsys, "inspect")[0] == 0
    finally:
        parity.cli.main._shared_parser.cache_clear()  # the next test's main() builds the real parser
    default = _flags(_subparsers(built[0])["inspect"])["--set"].default
    assert len(built) == 1 and default == [] and seen[0].overrides is not default
    assert [args.overrides for args in seen] == [["num_warps=8"], ["num_warps=4"], []]


# ---- one spelling per flag -------------------------------------------------------------------------

# Flags that mean the same thing wherever they appear: same spellings, metavar and help text.
SHARED = ("--json", "--junit-xml", "--html", "--markdown", "--quiet", "--impl", "--device", "--tolerances", "--max-rows",
          "--wide", "--budget", "--no-budget", "--strict-structure", "--debug")
# Flags whose help names the command's own role: same canonical spelling and metavar.
SAME_SPELLING = {"--bundle": ("capture", "compare"), "--set": ("capture", "inspect")}
OLD_SPELLINGS = {"capture": {"--out": "out", "--arg": "arg"}, "compare": {"--golden": "golden"}}


def test_shared_flags_read_the_same_in_every_command(commands):
    seen: dict[str, tuple[str, argparse.Action]] = {}
    for name, parser in commands.items():
        for flag, action in _flags(parser).items():
            if flag not in SHARED:
                continue
            if flag in seen:
                first_name, first = seen[flag]
                where = f"{flag} in {first_name} and {name}"
                assert action.option_strings == first.option_strings, where
                assert action.metavar == first.metavar, where
                assert action.help == first.help, where
                assert type(action) is type(first), where
            else:
                seen[flag] = (name, action)
    assert {"--json", "--junit-xml", "--html", "--quiet", "--impl", "--device", "--wide"} <= set(seen)
    for flag, names in SAME_SPELLING.items():
        actions = [_flags(commands[name])[flag] for name in names]
        assert all(action.option_strings[0] == flag for action in actions), flag
        assert len({action.metavar for action in actions}) == 1, flag
    # every command that writes a report, or shows progress, has the flag
    for name in ("compare", "diff", "inspect", "show"):
        assert "--json" in _flags(commands[name]), name
    for name in ("capture", "compare", "diff", "inspect"):
        assert "--quiet" in _flags(commands[name]), name
    for name in ("compare", "diff"):
        assert {"--html", "--markdown", "--wide", "--junit-xml"} <= set(_flags(commands[name])), name


@pytest.mark.parametrize("command, flag", [(c, f) for c, flags in OLD_SPELLINGS.items() for f in flags])
def test_old_spellings_still_parse_and_say_they_are_deprecated(commands, command, flag):
    action = _flags(commands[command])[flag]
    canonical = action.option_strings[0]
    assert canonical != flag and "deprecated alias" in action.help and flag in action.help
    argv = {"capture": ["capture", "--subject", "decoder"], "compare": ["compare"]}[command]
    value = "x=1" if flag == "--arg" else "somewhere"
    old = parity.cli.main.build_parser().parse_args([*argv, flag, value] + (["--bundle", "b"] if flag == "--arg" else []))
    new = parity.cli.main.build_parser().parse_args([*argv, canonical, value]
                                               + (["--bundle", "b"] if flag == "--arg" else []))
    assert vars(old) == vars(new) and getattr(old, action.dest) in (value, [value])


def test_inspect_has_quiet_and_set(commands):
    args = parity.cli.main.build_parser().parse_args(["inspect", "--quiet", "--set", "num_warps=8", "--json", "-"])
    assert args.quiet is True and args.overrides == ["num_warps=8"] and args.json == "-"


def test_inspect_set_help_names_every_config_key(commands):
    """The help is written out by hand (``parity --help`` imports no kernel module), so this keeps
    it from falling behind the keys ``--set`` takes (kernels/configs.py)."""
    from parity.kernels import configs

    action = _flags(commands["inspect"])["--set"]
    named = set(re.findall(r"\w+", action.help))
    assert set(configs.OVERRIDE_KEYS) <= named, set(configs.OVERRIDE_KEYS) - named


def test_help_shows_defaults_without_none_noise(commands, capsys):
    for name, parser in commands.items():
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
        assert "(default: [])" not in text, name
    capture_help = " ".join(commands["capture"].format_help().split())
    assert "(default: auto)" in capture_help and "(default: reference)" in capture_help
    assert "(default: 256.0)" in capture_help
    compare_help = " ".join(commands["compare"].format_help().split())
    assert "(default: triton)" in compare_help and "(default: auto)" in compare_help


def test_impl_help_lists_each_builtin_subjects_impls(commands):
    from parity.run.subjects.attention import AttentionSubject
    from parity.run.subjects.decoder import DecoderSubject

    text = _flags(commands["compare"])["--impl"].help
    assert "attention implementation" not in text
    assert f"attention: {', '.join(AttentionSubject.impls)}" in text
    assert f"decoder: {', '.join(DecoderSubject.impls)}" in text


@pytest.mark.parametrize("gpu, expected", [(True, "cuda"), (False, "cpu")])
def test_device_auto_follows_torch(monkeypatch, gpu, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert options.resolve_device("auto") == expected
    assert options.resolve_device("cpu") == "cpu"
    assert parity.cli.main.build_parser().parse_args(["capture", "--subject", "x", "--bundle", "b"]).device == "auto"


def test_capture_device_auto_captures_on_cpu_without_a_gpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "capture", "--subject", "attention", "--set", 'cases="smoke"', "--reference", "none",
                         "--bundle", str(tmp_path / "b"), "--quiet")
    assert code == 0, err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["platform"]["device"] == "cpu"
    assert len(manifest["subject"]["args"]["cases"]) == len(CASE_SETS["smoke"])


# ---- a subject with long and hostile layer names ---------------------------------------------------

HOSTILE = "x*y*_[z](u)<b>&c|d`e`~f~$g$"
LONG = "attention_output_projection_with_a_long_descriptive_name"


class Scaled(nn.Linear):
    def __init__(self, dim: int, noise: float):
        super().__init__(dim, dim)
        self.noise = noise

    def forward(self, x):
        y = super().forward(x)
        return y + self.noise * torch.cos(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape)


class Block(nn.Module):
    def __init__(self, dim: int, noise: float):
        super().__init__()
        self.add_module(LONG, Scaled(dim, noise))
        self.add_module(HOSTILE, nn.Tanh())

    def forward(self, x):
        return x + getattr(self, HOSTILE)(getattr(self, LONG)(x))


class Tower(nn.Module):
    def __init__(self, dim: int, noise_at: int | None):
        super().__init__()
        self.transformer_decoder_stack_of_blocks = nn.ModuleList(
            [Block(dim, 1e-3 if index == noise_at else 0.0) for index in range(3)])

    def forward(self, x):
        for block in self.transformer_decoder_stack_of_blocks:
            x = block(x)
        return x


class TowerSubject(Subject):
    name = "tower"
    impls = ("reference", "perturbed")

    def make_inputs(self):
        return Inputs({"x": torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))})

    def make_state(self):
        gen = torch.Generator().manual_seed(1)
        state = self.build("reference").state_dict()
        return {name: torch.randn(t.shape, generator=gen) * 0.3 for name, t in state.items()}

    def build(self, impl):
        return Tower(8, 1 if impl == "perturbed" else None)

    def call(self, module, inputs):
        return module(inputs.tensors["x"])


def make_tower():
    return TowerSubject()


TOWER = f"{__name__}:make_tower"


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    root = tmp_path_factory.mktemp("tower")
    with trusting(TOWER):
        capture(TOWER, root / "golden", record_inputs=True)
        capture(TOWER, root / "candidate", impl="perturbed", record_inputs=True)
    return root


@pytest.fixture
def trusted():
    with trusting(TOWER):
        yield


def _table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("| ")]


def test_isolate_budget_table_fits_120_columns_and_wide_has_every_column(tower, trusted, capsys):
    argv = ["compare", "--bundle", str(tower / "golden"), "--impl", "perturbed", "--device", "cpu", "--quiet",
            "--isolate", "--budget"]
    code, out, err = run(capsys, *argv)
    assert code == 1, err
    rows = _table_rows(out)
    assert len(rows) == 1 + 3 * 3 + 1  # header; per block: linear, tanh, the block; <root> last
    assert max(len(line) for line in out.splitlines() if line.startswith("|")) <= 120
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    # what a reader needs stays: the name, dtype, the three metrics, the verdict, and where the
    # error comes from (isolated rel L2 and introduced/inherited in one column)
    assert header == ["tensor", "dtype", "cosine", "max abs", "rel L2", "verdict", "isolated"]
    assert "…" in out  # long names are shortened in the middle of their longest parts
    assert sum(".1." in row for row in rows) == 2  # the block index survives: both modules of block 1
    names = [row.split(" | ")[0][2:].rstrip() for row in rows[1:]]
    assert all(name.endswith(("_name", "$", ".0", ".1", ".2", ">")) for name in names), names  # ends kept
    assert re.search(r"\| FAIL [a-z_,+0-9]+ +\| \S+ introduced +\|$", out, re.M)
    assert out.rstrip().splitlines()[-1].startswith("PARITY FAILS: first failing tensor "
                                                    f"transformer_decoder_stack_of_blocks.1.{LONG}")

    code, wide, err = run(capsys, *argv, "--wide")
    assert code == 1, err
    wide_header = [cell.strip() for cell in _table_rows(wide)[0].strip("|").split("|")]
    assert set(header) - {"isolated"} < set(wide_header) and "isolated" not in wide_header
    for column in ("shape", "mismatch %", "iso max abs", "iso verdict", "ref rel L2 here", "ref rel L2 golden"):
        assert column in wide_header, column
    assert "…" not in wide and f"transformer_decoder_stack_of_blocks.1.{LONG} " in wide
    assert max(len(line) for line in wide.splitlines()) > 120


def test_terminal_table_shows_names_as_they_are(tower, trusted, capsys):
    # Markdown escapes belong to --markdown output (test_markdown_report_escapes_names_and_reasons);
    # on a terminal they are noise (\\<root\\>, layers.\\*.attn).
    code, out, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--quiet", "--wide")
    assert code == 1, err
    assert markdown_escape(HOSTILE) == r"x\*y\*\_[z\](u)\<b\>\&c\|d\`e\`\~f\~\$g\$"
    rows = _table_rows(out)
    assert rows[-1].startswith("| <root> ")
    assert any(f"transformer_decoder_stack_of_blocks.0.{HOSTILE.replace('|', chr(92) + '|')} " in row for row in rows)
    assert "\\" not in "\n".join(rows).replace("\\|", "")  # only a "|" in a name is escaped: it would split the cell
    assert "transformer_decoder_stack_of_blocks" in out and "attention_output" in out


def test_shorten_name_keeps_both_ends_within_the_width():
    name = "model.layers.31.self_attn.q_proj.<lora>.default"
    for width in (16, 20, 30, 40):
        cell = shorten_name(name, width)
        assert len(cell) <= width and "…" in cell, (width, cell)
        assert cell.startswith("model") and cell.endswith("ult")  # at 30: the parts cut, "de…ult"
        assert "\\" not in cell  # a terminal cell: no Markdown escapes
        markdown = shorten_name(name, width, markdown=True)
        assert len(markdown) <= width and "<" not in markdown.replace("\\<", ""), (width, markdown)
    assert shorten_name("layers.0", 16) == "layers.0"

def test_terminal_cells_have_no_markdown_escapes():
    # the names the profile and bench tables show (shorten_name), as a person reads them
    for name in ("<root>", "layers.*.attn.core", "aten::copy_", "_fwd_kernel"):
        assert shorten_name(name, 40) == name
    assert shorten_name("<root>", 40, markdown=True) == "\\<root\\>"
    assert shorten_name("aten::copy_", 40, markdown=True) == "aten::copy\\_"


def test_shorten_name_of_megabytes_cuts_it_at_once(monkeypatch):
    # An imported kernel's name may run to megabytes (50,000 characters here): cut to its ends first, it takes a few hundred
    # trial cuts (it took one per character, minutes, when every cut was tried one by one).
    from parity.report import text

    calls = []
    real_cut = text._cut

    def counted(part, length, markdown=False):
        calls.append(length)
        if len(calls) > 10_000:
            raise AssertionError("shorten_name tries a cut per character of the name")
        return real_cut(part, length, markdown)

    monkeypatch.setattr(text, "_cut", counted)
    cell = shorten_name("kernel_" + "x" * 50_000 + ".tail_part", 40)
    assert len(cell) <= 40 and cell.startswith("kernel_") and cell.endswith("tail_part")
    assert len(calls) < 1_000


# ---- '-' is standard output; --html ---------------------------------------------------------------


def test_json_dash_is_stdout_in_compare_and_diff(tower, trusted, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "compare", "--bundle", str(tower / "golden"), "--impl", "perturbed",
                         "--device", "cpu", "--quiet", "--json", "-")
    assert code == 1, err
    document = json.loads(out)  # the JSON alone: no text report around it
    assert document["passed"] is False and not (tmp_path / "-").exists()
    code, out, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--quiet",
                         "--junit-xml", "-")
    assert code == 1 and out.startswith("<?xml") and "PARITY FAILS" in out and not (tmp_path / "-").exists()
    code, out, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--quiet", "--json", "./-")
    assert code == 1 and "PARITY FAILS" in out and json.loads((tmp_path / "-").read_text())["passed"] is False


def test_two_reports_on_stdout_is_a_usage_error(tower, capsys):
    code, out, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--json", "-",
                         "--junit-xml", "-")
    assert code == 2 and err.count("\n") == 1
    assert "--json - and --junit-xml -: only one report can go to standard output" in err


def test_an_error_with_json_dash_writes_the_error_document_to_stdout(tmp_path, capsys):
    code, out, err = run(capsys, "compare", "--bundle", str(tmp_path / "nowhere"), "--json", "-")
    assert code == 2 and err.startswith("parity: error: ")
    assert json.loads(out)["error"]["status"] == 2


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.text = []

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.parametrize("command", ["compare", "diff"])
def test_html_writes_a_page_with_the_verdict(tower, trusted, capsys, tmp_path, command):
    page = tmp_path / "report.html"
    argv = (["compare", "--bundle", str(tower / "golden"), "--impl", "perturbed", "--device", "cpu"]
            if command == "compare" else ["diff", str(tower / "golden"), str(tower / "candidate")])
    code, out, err = run(capsys, *argv, "--quiet", "--html", str(page))
    assert code == 1, err
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("PARITY FAILS: first failing tensor ")
    parser = _Page()
    parser.feed(page.read_text(encoding="utf-8"))
    parser.close()
    text = " ".join("".join(parser.text).split())
    assert verdict in text
    assert f"parity {command}: " in text  # the page says which command judged


@pytest.mark.parametrize("command", ["compare", "diff"])
def test_html_bad_path_fails_before_comparing(tower, capsys, tmp_path, command):
    argv = (["compare", "--bundle", str(tower / "golden"), "--impl", "perturbed", "--device", "cpu"]
            if command == "compare" else ["diff", str(tower / "golden"), str(tower / "candidate")])
    code, out, err = run(capsys, *argv, "--html", str(tmp_path / "missing" / "r.html"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert re.search(r"^parity: error: --html .*r\.html: directory .*missing does not exist$", err)


# ---- reasons and "would pass with" -----------------------------------------------------------------


def _fp32_pair(gap_scale: float):
    ref = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    return ref + gap_scale * noise * ref.abs().mean(), ref


def test_fp32_cosine_reason_tells_the_numbers_apart():
    out, ref = _fp32_pair(2e-4)
    result = compare_tensors("fp32.out", out, ref)
    reason = next(r for r in result.verdict.reasons if r.startswith("cosine "))
    match = re.fullmatch(r"cosine 1-(\S+) < 1-(\S+)", reason)
    assert match, reason
    observed_gap, limit_gap = (float(text) for text in match.groups())
    assert observed_gap > limit_gap
    assert math.isclose(limit_gap, 2e-10, rel_tol=0.05)
    assert math.isclose(observed_gap, 1 - result.metrics.cosine, rel_tol=0.05)


def _loads(key: str, text: str) -> bool:
    import tomllib

    try:
        Policy.from_mapping({"layers": [{"match": "*", key: tomllib.loads(f"v = {text}")["v"]}]}, "t")
    except Exception:  # noqa: BLE001
        return False
    return True


def test_would_pass_never_proposes_a_value_the_loader_rejects():
    # Against an all-zero golden, rel L2 is infinite and so is the atol_rms that would pass (ref rms 0).
    ref = torch.zeros(256)
    out = 1e-3 * torch.randn(256, generator=torch.Generator().manual_seed(5))
    result = compare_tensors("zeros", out, ref)
    checks = result.failed_checks()
    assert math.isinf(checks["atol_rms"]) and "max_rel_l2" in checks
    assert would_pass_text(result) is None  # no finite max_rel_l2 passes
    assert "max_rel_l2" in unrelaxable_checks(result) and "atol_rms" in unrelaxable_checks(result)


def test_mismatch_names_the_alternative_that_cannot_relax_it():
    ref = torch.zeros(256)
    out = torch.zeros(256)
    out[7] = 1e-3
    loose = Tolerance(atol=0.0, rtol=0.0, max_mismatch_fraction=0.0, min_cosine=-1.0, max_rel_l2=math.inf)
    result = compare_tensors("sparse", out, ref, tolerance=loose)
    text = would_pass_text(result)
    assert text is not None and "inf" not in text
    assert "(atol_rms and rtol cannot relax it: no finite value passes)" in text
    proposed = re.findall(r"(\w+) = ([^ ,()]+)", text)
    assert {key for key, _ in proposed} >= {"max_mismatch_fraction", "atol"}
    for key, value in proposed:
        assert _loads(key, value), (key, value)


def test_markdown_report_escapes_names_and_reasons(tower, trusted, capsys, tmp_path):
    code, out, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--quiet",
                         "--markdown", "-")
    assert code == 1, err
    assert "PARITY FAILS" in out and not out.startswith("parity diff:")  # the Markdown alone
    lines = out.splitlines()
    assert lines[0].startswith("**PARITY FAILS: first failing tensor ") and lines[-1] == lines[0]
    assert "- " + "golden host: " in out and "| tensor " in out and "| shape " in out  # every column
    assert "<" not in out.replace("\\<", "") and ">" not in out.replace("\\>", "")
    assert f"transformer_decoder_stack_of_blocks.1.{markdown_escape(HOSTILE)}" in out
    assert re.search(r"^  - cosine 1-\S+ \\< 1-\S+$", out, re.M)  # reasons: a sublist per tensor, escaped
    code, text, err = run(capsys, "diff", str(tower / "golden"), str(tower / "candidate"), "--quiet",
                          "--markdown", str(tmp_path / "r.md"))
    assert code == 1 and (tmp_path / "r.md").read_text(encoding="utf-8") == out
    assert text.rstrip().splitlines()[-1] == lines[0].strip("*").replace("\\", "")


@pytest.mark.parametrize("command", ["bench", "profile", "diff", "show", "verify", "inspect"])
def test_a_command_that_is_not_rank_aware_refuses_several_ranks(command, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = {"bench": ["--subject", "decoder", "--impls", "reference,triton"], "profile": ["--subject", "decoder"],
            "diff": ["a", "b"], "show": ["a"], "verify": ["a"], "inspect": []}[command]
    assert parity.cli.main.main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"parity: error: parity {command} runs in one process, not on each of 2 ranks (WORLD_SIZE=2, as "
                   "torchrun sets it): run it without torchrun; under torchrun, capture and compare take rank sets")


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "1"},  # a one-rank launch
                                 {"WORLD_SIZE": "4"},  # left in the environment, no launch (torchrun sets RANK too)
                                 {"RANK": "1", "WORLD_SIZE": "\u00b9"},  # not a number: no launch to refuse, no crash
                                 {"RANK": "1", "WORLD_SIZE": ""}])
def test_no_several_rank_launch_runs_a_command_that_is_not_rank_aware(monkeypatch, capsys, tmp_path, env):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parity.cli.main.main(["verify", str(tmp_path / "missing")]) == 2  # the command's own error, not the launch's
    err = capsys.readouterr().err
    assert "runs in one process" not in err and "does not exist" in err


def test_no_command_prints_the_commands_and_exits_2(capsys):
    assert parity.cli.main.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m parity")
    for command in parity.cli.main.COMMANDS:
        assert f"\n    {command} " in err  # each command with its one-line help
    assert "argparse" not in err and "thin over the library API" not in err  # no developer docstring


@pytest.mark.parametrize("argv, line", [
    (["compare", "--bundel", "x"], "parity: error: unknown option --bundel for parity compare (did you mean --bundle?)"),
    (["--debug", "capture", "--subjet", "decoder"],
     "parity: error: unknown option --subjet for parity capture (did you mean --subject?)"),
    (["comapre", "--bundle", "x"], "parity: error: unknown command 'comapre' (did you mean compare?); commands: "
                                   "capture, compare, diff, inspect, show, verify, profile, bench"),
    (["capture", "--subject", "decodr", "--out", "OUT"],
     "parity: error: unknown subject 'decodr' (did you mean decoder?); use a built-in (attention, decoder) or "
     "package.module:factory"),
])
def test_a_mistyped_command_option_or_subject_names_the_closest_spelling(argv, line, capsys, tmp_path):
    argv = [str(tmp_path / "out") if word == "OUT" else word for word in argv]
    assert parity.cli.main.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_no_spelling_is_suggested_where_none_is_close_or_the_option_is_a_prefix(capsys):
    parser = parity.cli.main.build_parser()
    misspelling = parity.cli.main.misspelling
    assert misspelling(parser, ["compare", "--bund", "x"]) is None  # argparse takes a unique prefix
    assert misspelling(parser, ["compare", "--bundle", "x", "--", "--bundel"]) is None  # past "--": not options
    assert misspelling(parser, ["compare", "--bundle=x", "--impl", "triton"]) is None
    assert misspelling(parser, ["frobnicate"]) is None  # nothing close: argparse's own message
    # an option's value that starts with "--" is a value, not a misspelled option
    assert misspelling(parser, ["capture", "--subject", "attention", "--bundle", "--out dir"]) is None
    assert misspelling(parser, ["capture", "--set", "--impls", "--subject", "attention"]) is None
    assert misspelling(parser, ["capture", "--set", "x=1", "--subjet", "attention"]) is not None
    assert parity.cli.main.main(["compare", "--xyzzy"]) == 2
    assert "did you mean" not in capsys.readouterr().err
