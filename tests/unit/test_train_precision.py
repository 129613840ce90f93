"""`train.mixed_precision: auto` on CPU: bf16 where the CPU has native bf16 maths, fp32 elsewhere."""

from __future__ import annotations

import pytest

from longdoc.train.config import RecipeError, recipe_from_dict
from longdoc.train.modeling import cpu_bf16_flags, resolve_mixed_precision
from longdoc.train.world import check_launch

_EPYC = ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n"
         "processor\t: 1\nflags\t\t: fpu avx512_bf16\n")
_SPR = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile avx512_bf16\n"
_OLD = "flags\t\t: fpu sse2 avx2 fma\n"
_ARM = "Features\t: fp asimd bf16 i8mm\n"  # aarch64 bf16 is not the x86 native path measured here


@pytest.mark.parametrize("text, flags, auto", [(_EPYC, ["avx512_bf16"], "bf16"),
                                               (_SPR, ["avx512_bf16", "amx_bf16"], "bf16"),
                                               (_OLD, [], "no"), (_ARM, [], "no")])
def test_auto_follows_the_cpu_flags(tmp_path, text, flags, auto):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert cpu_bf16_flags(info) == flags
    assert resolve_mixed_precision("auto", cuda=False, cpuinfo=info) == auto
    assert resolve_mixed_precision("auto", cuda=True, cpuinfo=info) == "bf16"
    for explicit in ("no", "bf16"):
        assert resolve_mixed_precision(explicit, cuda=False, cpuinfo=info) == explicit


def test_no_cpuinfo_means_fp32(tmp_path):
    assert cpu_bf16_flags(tmp_path / "missing") == []
    assert resolve_mixed_precision("auto", cuda=False, cpuinfo=tmp_path / "missing") == "no"


def test_bf16_is_accepted_on_cpu():
    recipe = recipe_from_dict({"data": {"path": "random"}, "train": {"mixed_precision": "bf16"}})
    assert check_launch(recipe, world_size=1, cuda=False) == (1, 1)
    with pytest.raises(RecipeError, match="train.mixed_precision"):
        recipe_from_dict({"data": {"path": "random"}, "train": {"mixed_precision": "fp8"}})
