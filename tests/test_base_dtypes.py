"""parity.base.dtypes: every spelling of a dtype maps to one short name, torch dtype and Triton type."""
import pytest
import torch

from parity.base import dtypes
from parity.cli.main import main
from parity.base.errors import UsageError

EXPECTED = {
    "fp64": (torch.float64, "float64", "fp64", ("double",)),
    "fp32": (torch.float32, "float32", "fp32", ("float",)),
    "fp16": (torch.float16, "float16", "fp16", ("half",)),
    "bf16": (torch.bfloat16, "bfloat16", "bf16", ()),
}


@pytest.mark.parametrize("short", list(EXPECTED))
def test_round_trips_through_every_spelling(short):
    dtype, torch_name, triton_name, aliases = EXPECTED[short]
    for spelling in (short, torch_name, f"torch.{torch_name}", dtype, *aliases):
        assert dtypes.short_name(spelling) == short, spelling
        assert dtypes.torch_dtype(spelling) is dtype, spelling
        assert dtypes.torch_name(spelling) == torch_name, spelling
        assert dtypes.triton_name(spelling) == triton_name, spelling
    assert dtypes.torch_dtype(dtypes.short_name(dtype)) is dtype
    assert dtypes.short_name(dtypes.torch_name(short)) == short
    assert dtypes.triton_pointer(dtype) == "*" + triton_name
    assert dtypes.lookup(dtype) == dtypes.lookup(torch_name) == short


def test_lookup_returns_none_for_other_dtypes_instead_of_raising():
    for other in (torch.int64, torch.bool, "int64", "torch.float8_e4m3fn", "", None, 3):
        assert dtypes.lookup(other) is None


def test_the_vocabulary_is_exactly_the_four_floats_and_the_kernel_uses_three():
    assert dtypes.FLOATING == ("fp64", "fp32", "fp16", "bf16")
    assert dtypes.KERNEL_DTYPES == ("fp16", "bf16", "fp32")
    from parity.kernels import aot, attention

    assert attention.SUPPORTED_DTYPES == (torch.float16, torch.bfloat16, torch.float32)
    assert aot.DTYPES == dtypes.KERNEL_DTYPES


@pytest.mark.parametrize("bad", ["fp8", "float8_e4m3fn", "", "BF16", "torch.", torch.int32, torch.float8_e5m2,
                                 None, 16])
def test_unknown_names_fail_with_one_line_naming_the_value_and_the_choices(bad):
    with pytest.raises(UsageError) as info:
        dtypes.torch_dtype(bad)
    message = str(info.value)
    assert message.startswith("unknown dtype ") and "\n" not in message
    assert message.endswith("; use one of fp64, fp32, fp16, bf16")
    assert (repr(bad) if isinstance(bad, str) else str(bad)) in message


def test_check_name_limits_the_choices_and_says_where_the_value_came_from():
    assert dtypes.check_name("bfloat16") == "bf16"
    assert dtypes.check_name("torch.float32", ("fp32",)) == "fp32"
    with pytest.raises(UsageError, match=r"^unknown --dtype 'fp64'; use one of fp16, bf16, fp32$"):
        dtypes.check_name("fp64", what="--dtype")
    with pytest.raises(UsageError, match=r"^unknown dtype 3; use one of fp16$"):
        dtypes.check_name(3, ("fp16",))
    # A control character in a user's value is escaped, never printed raw.
    with pytest.raises(UsageError) as info:
        dtypes.short_name("bf\x1b[2J16")
    assert "\x1b" not in str(info.value)


def test_accumulation_dtype_is_fp64_only_for_fp64():
    assert dtypes.accumulation_dtype(torch.float64) is torch.float64
    assert dtypes.accumulation_dtype("double") is dtypes.accumulation_dtype("fp64") is torch.float64
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, "bf16", "integer"):
        assert dtypes.accumulation_dtype(dtype) is torch.float32


def test_config_table_and_reference_use_the_vocabulary():
    from parity.kernels import configs, reference

    assert configs.config_for("sm_90", 128, "float32") == configs.config_for("sm_90", 128, torch.float32)
    assert configs.config_for("sm_90", 128, "float32") != configs.config_for("sm_90", 128, "bf16")
    with pytest.raises(ValueError, match="unknown dtype 'fp12'"):  # the kernel layer's own error
        configs.config_for("sm_90", 128, "fp12")
    assert reference._compute_dtype("fp64", torch.bfloat16) is torch.float64
    assert reference._compute_dtype("same", torch.bfloat16) is torch.bfloat16


def test_inspect_accepts_any_spelling_and_rejects_unknown_ones_before_compiling(capsys):
    # Bad arguments are found before anything compiles: exit 2, one line.
    assert main(["inspect", "--dtype", "bfloat16", "--set", "tiles=1"]) == 2
    assert "unknown config key 'tiles'" in capsys.readouterr().err
    assert main(["inspect", "--dtype", "float8"]) == 2
    err = capsys.readouterr().err
    assert err == "parity: error: unknown dtype 'float8'; use one of fp16, bf16, fp32\n"
