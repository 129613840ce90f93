"""docs/models/survey.json (written by `python -m tests.support.survey`, about 3 minutes) is re-checked on every run: no
result differs from one process, it names the locked transformers, and it is unbuilt only where there is no text
decoder. A lock bump that does not re-run the survey fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import transformers

from tests.support import survey

ROOT = Path(__file__).resolve().parents[2]
RECORD = json.loads((ROOT / "docs/models/survey.json").read_text())


def _locked(name: str) -> str:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    found = [m.group(1) for line in lines if (m := re.fullmatch(rf"{name}==(\S+)", line.strip()))]
    assert len(found) == 1, f"constraints.txt should pin {name} once, found {found}"
    return found[0]


def test_no_result_is_wrong_or_a_crash():
    bad = {t: r for t, r in RECORD["types"].items() if r["status"] not in ("exact", "refused", "unbuilt")}
    assert not bad, bad
    counts: dict[str, int] = {}
    for r in RECORD["types"].values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    assert counts == RECORD["counts"]
    assert RECORD["cp"] >= 2


def test_recorded_for_the_locked_transformers():
    locked = _locked("transformers")
    assert RECORD["transformers"] == locked, (
        f"survey.json was written with transformers {RECORD['transformers']}, constraints.txt locks {locked}: "
        f"re-run `python -m tests.support.survey` (about 3 minutes)")
    if transformers.__version__ == locked:  # make test-latest runs newer releases: the record is for the lock
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        assert set(RECORD["types"]) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_unbuilt_only_without_a_text_decoder():
    for t, r in RECORD["types"].items():
        if r["status"] == "unbuilt":
            assert t in survey._NOT_TEXT and r["detail"] == survey._NOT_TEXT[t], (t, r)
    for t, reason in survey._NOT_TEXT.items():
        assert re.match(r"no (text decoder|standalone decoder|text-only forward)", reason), (t, reason)
