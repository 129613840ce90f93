"""The `preference:` section of a training recipe: how `data.task: preference` rows train (longdoc.train.dpo).

    preference:
      loss: sigmoid        # DPO against the LoRA-disabled base (needs lora.enabled) | simpo: reference-free
      beta: 0.1
      simpo_gamma: null    # simpo's target reward margin; null: 0.5 (TRL's CPOConfig default)
      cache_reference: true
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from longdoc.train.recipe_parse import check as _check

PreferenceLoss = Literal["sigmoid", "simpo"]
SIMPO_GAMMA = 0.5  # TRL 1.16.0 CPOConfig.simpo_gamma


@dataclass(kw_only=True, slots=True)
class PreferenceConfig:
    loss: PreferenceLoss = "sigmoid"  # TRL's DPO loss_type="sigmoid", or SimPO (TRL's CPO loss_type="simpo")
    beta: float = 0.1  # the temperature of both losses (TRL's default)
    simpo_gamma: float | None = None  # simpo only: the target margin; null: SIMPO_GAMMA
    # sigmoid: keep each row's reference log-probabilities after its first forward (the base is frozen, so they
    # never change): later epochs skip the reference forward; 16 bytes per pair of host memory
    cache_reference: bool = True

    def __post_init__(self):
        kinds = typing.get_args(PreferenceLoss)
        _check(self.loss in kinds, "preference.loss", f"must be one of {kinds}, got {self.loss!r}")
        _check(self.beta > 0, "preference.beta", f"must be positive, got {self.beta}")
        _check(self.simpo_gamma is None or self.loss == "simpo", "preference.simpo_gamma",
               f"applies to preference.loss=simpo only (the loss is {self.loss!r}); remove it or set loss: simpo")
        _check(self.simpo_gamma is None or self.simpo_gamma >= 0, "preference.simpo_gamma",
               f"must be >= 0 (a target reward margin), got {self.simpo_gamma}")

    @property
    def gamma(self) -> float:
        """SimPO's margin in effect (0 for the sigmoid loss)."""
        if self.loss != "simpo":
            return 0.0
        return SIMPO_GAMMA if self.simpo_gamma is None else float(self.simpo_gamma)
