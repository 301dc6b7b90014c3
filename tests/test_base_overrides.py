"""parity.base.overrides: the one KEY=VALUE parser (inspect --set, the benchmark's --config, capture --arg)."""
import math

import pytest

from parity.cli.main import main
from parity.base.errors import UsageError
from parity.base.overrides import boolean, integer, json_value, number, parse_overrides

SIZES = {"block_m": integer(1, 1024), "one_loop": boolean, "scale": number(0.0, 10.0)}


def test_values_are_converted_by_their_key_in_the_given_order():
    got = parse_overrides(["one_loop=true", " block_m = 64", "scale=0.5"], flag="--set", allowed=SIZES)
    assert got == {"one_loop": True, "block_m": 64, "scale": 0.5}
    assert list(got) == ["one_loop", "block_m", "scale"]
    assert parse_overrides([], flag="--set", allowed=SIZES) == {}
    # Any key, the text kept as is (the value may itself contain '=').
    assert parse_overrides(["name=a=b", "empty="], flag="--arg") == {"name": "a=b", "empty": ""}


@pytest.mark.parametrize("items, message", [
    (["block_m"], "--set 'block_m' must look like KEY=VALUE"),
    (["=64"], "--set '=64': the key before '=' is empty"),
    ([" =64"], "--set ' =64': the key before '=' is empty"),
    (["tiles=3"], "--set 'tiles=3': unknown key 'tiles'; use one of block_m, one_loop, scale"),
    (["block_m=64", "block_m=32"], "--set 'block_m=32': key 'block_m' is given twice"),
    (["block_m=big"], "--set 'block_m=big': expected an integer from 1 to 1024, got 'big'"),
    (["block_m=1.5"], "--set 'block_m=1.5': expected an integer from 1 to 1024, got '1.5'"),
    (["block_m=0"], "--set 'block_m=0': expected an integer from 1 to 1024, got 0"),
    (["block_m=4096"], "--set 'block_m=4096': expected an integer from 1 to 1024, got 4096"),
    (["block_m=" + "9" * 5000], "expected an integer from 1 to 1024, got '9999"),
    (["one_loop=2"], "--set 'one_loop=2': expected 0 or 1 (or true/false), got '2'"),
    (["scale=nan"], "--set 'scale=nan': expected a finite number from 0 to 10, got 'nan'"),
    (["scale=inf"], "--set 'scale=inf': expected a finite number from 0 to 10, got 'inf'"),
    (["scale=-1"], "--set 'scale=-1': expected a finite number from 0 to 10, got '-1'"),
    (["scale=x"], "--set 'scale=x': expected a number, got 'x'"),
], ids=["no-equals", "empty-key", "blank-key", "unknown-key", "duplicate", "not-int", "fraction", "below",
        "above", "huge", "not-bool", "nan", "inf", "negative", "not-number"])
def test_each_bad_item_is_one_line_naming_flag_item_and_problem(items, message):
    with pytest.raises(UsageError) as info:
        parse_overrides(items, flag="--set", allowed=SIZES)
    text = str(info.value)
    assert "\n" not in text and len(text) < 300
    assert text.startswith("--set ") and message in text, text


def test_key_name_words_the_messages():
    with pytest.raises(UsageError, match=r"^--set 'x=1': unknown config key 'x'; use one of block_m"):
        parse_overrides(["x=1"], flag="--set", allowed=SIZES, key_name="config key")


def test_json_values_parse_and_absurd_ones_are_refused():
    convert = json_value(max_int=2**31)
    got = parse_overrides(['n=8', 'shape=[1, 2]', 'flag=true', 'cfg={"a": 0.5}', 'kind=causal', 'none=null'],
                          flag="--arg", convert=convert)
    assert got == {"n": 8, "shape": [1, 2], "flag": True, "cfg": {"a": 0.5}, "kind": "causal", "none": None}
    for text, needle in [("NaN", "nan is not a finite number"), ("-Infinity", "-inf is not a finite number"),
                         ("[1, [Infinity]]", "inf is not a finite number"),
                         (str(2**31 + 1), f"integer {2**31 + 1} is out of range (at most {2**31} in magnitude)"),
                         ('{"a": [-4294967296]}', "integer -4294967296 is out of range"),
                         ("1" * 5000, "integer of 5000 digits is out of range")]:
        with pytest.raises(UsageError) as info:
            parse_overrides([f"x={text}"], flag="--arg", convert=convert)
        assert needle in str(info.value) and str(info.value).startswith("--arg "), str(info.value)
    assert math.isclose(parse_overrides(["x=1e3"], flag="--arg", convert=convert)["x"], 1000.0)


def test_a_control_character_in_an_item_is_escaped():
    with pytest.raises(UsageError) as info:
        parse_overrides(["\x1b[2J=1"], flag="--set", allowed=SIZES)
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)


@pytest.mark.parametrize("argv, needle", [
    (["--set", "num_warps=inf"], "--set 'num_warps=inf': expected an integer from 1 to 65536"),
    (["--set", "block_n=1048576"], "expected an integer from 1 to 65536, got 1048576"),
    (["--set", "block_n=64", "--set", "block_n=32"], "config key 'block_n' is given twice"),
    (["--set", "tma=yes please"], "--set 'tma=yes please': expected 0 or 1"),
    (["--set", "=8"], "--set '=8': the config key before '=' is empty"),
    (["--target", "sm_90", "--set", "kpack=2"], "unknown config key 'kpack' for sm_90"),
], ids=["inf", "huge", "twice", "flag", "empty-key", "amd-knob-on-nvidia"])
def test_inspect_set_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(["inspect", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("parity: error: ") and needle in captured.err


def test_configs_apply_parsed_overrides():
    from parity.kernels import configs

    base = configs.config_for("gfx942", 128, "bf16")
    changes = parse_overrides(["block_n=32", "waves_per_eu=1", "one_loop=1"], flag="--set",
                              allowed=configs.OVERRIDE_KEYS)
    cfg = configs.with_overrides(base, changes, "gfx942")
    assert (cfg.block_m, cfg.block_n, cfg.one_loop, dict(cfg.amd)["waves_per_eu"]) == (128, 32, True, 1)
    assert dict(cfg.amd)["kpack"] == dict(base.amd)["kpack"]
    with pytest.raises(ValueError, match="unknown config key 'kpack' for sm_90"):
        configs.with_overrides(configs.config_for("sm_90", 128, "bf16"), {"kpack": 2}, "sm_90")
