"""Recipe fields with a fixed set of values are Literal types (the CP core's Layout for the layout; the strategy is
any name the strategy registry holds), and a value outside the set is refused at load time with the valid choices."""

from __future__ import annotations

import re
import typing

import pytest

from longdoc.parallel import strategy as registry
from longdoc.parallel.layout import LAYOUTS, Layout
from longdoc.train.config import ModelConfig, ParallelismConfig, RecipeError, recipe_from_dict


def test_cp_fields_use_the_core_types():
    hints = typing.get_type_hints(ParallelismConfig)
    assert hints["layout"] is Layout and typing.get_args(hints["layout"]) == LAYOUTS
    assert hints["strategy"] is str and registry.names()[:4] == ("ring", "allgather", "ulysses", "usp")


@pytest.mark.parametrize("override,choices", [
    ("parallelism.layout=zz", "('zigzag', 'contiguous')"),
    ("parallelism.strategy=p2p", "('ring', 'allgather', 'ulysses', 'usp')"),
    ("model.dtype=fp8", "('float32', 'bfloat16', 'float16')"),
    ("train.on_nonfinite=ignore", "('skip', 'abort')"),
    ("optim.decay=step", "('cosine', 'linear', 'constant')"),
    ("data.task=summarise", "('qa', 'pretrain', 'chat', 'preference')"),
    ("data.chat_loss=prompt", "('assistant', 'all')"),
])
def test_a_value_outside_the_choices_names_them(override, choices):
    key, value = override.split("=")
    with pytest.raises(RecipeError, match=re.escape(f"{key}: must be one of {choices}, got {value!r}")):
        recipe_from_dict({"data": {"path": "random"}}, [override])


def test_valid_choices_load_and_code_built_sections_are_checked_too():
    r = recipe_from_dict({"data": {"path": "random"}}, ["parallelism.layout=contiguous",
                                                        "parallelism.strategy=allgather", "model.dtype=bfloat16"])
    assert (r.parallelism.layout, r.parallelism.strategy, r.model.dtype) == ("contiguous", "allgather", "bfloat16")
    with pytest.raises(RecipeError,
                       match=r"parallelism.strategy: must be one of \('ring', 'allgather', 'ulysses', 'usp'\)"):
        ParallelismConfig(strategy="p2p")
    with pytest.raises(RecipeError, match="model.dtype: must be one of"):
        ModelConfig(dtype="fp8")
