"""`task: preference`: TRL's text and conversational pairs read and tokenized as TRL's DPOTrainer does, the
shared-prefix row's schema (positions, labels, branches, packing), bad rows named and counted, and the crux: a tiny
model run on the shared-prefix row with the sibling mask gives per-pair log-probability sums equal to the
two-sequence form."""

from __future__ import annotations

import json

import pytest
import torch

from longdoc.corpus.ingest import CorpusError, Skips, read_documents
from longdoc.corpus.preference import shared_prefix_row, tokenize_pair
from longdoc.corpus.preference_logps import (
    additive_mask,
    branch_targets,
    pair_logps,
    sequence_logp,
    shifted_targets,
    sibling_mask,
    two_sequence_rows,
)
from longdoc.corpus.prepare import prepare
from longdoc.corpus.tokens import get_tokenizer
from longdoc.corpus.windows import IGNORE

DOC = " ".join(f"Clause {i}: the tenant shall pay rent on day {i % 28 + 1}." for i in range(30))
TEXT = {"prompt": f"{DOC}\n\nQuestion: when is rent due under clause 3?\nAnswer:", "chosen": " On day 4.",
        "rejected": " On day 5."}
CONV = {"prompt": [{"role": "user", "content": f"{DOC}\n\nWhen is rent due under clause 30?"}],
        "chosen": [{"role": "assistant", "content": "On day 3."}],
        "rejected": [{"role": "assistant", "content": "On the first Monday of every month."}]}


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _check_row(row: dict, triples: list[tuple[list[int], list[int], list[int]]]) -> None:
    """The schema of longdoc.corpus.preference, pair by pair."""
    assert len(row["branches"]) == len(triples)
    at = 0
    for (p_ids, c_ids, r_ids), (p, c, r, e) in zip(triples, row["branches"]):
        assert (p, c, r, e) == (at, at + len(p_ids), at + len(p_ids) + len(c_ids), at + len(p_ids) + len(c_ids)
                                + len(r_ids))
        assert row["input_ids"][p:e] == p_ids + c_ids + r_ids
        assert row["position_ids"][p:c] == list(range(c - p))
        assert row["position_ids"][c:r] == list(range(c - p, r - p))
        assert row["position_ids"][r:e] == list(range(c - p, c - p + e - r)), "rejected continues from the prompt"
        assert row["labels"][p:c] == [IGNORE] * (c - p)
        assert row["labels"][c:e] == c_ids + r_ids
        at = e
    assert at == len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"])


# ------------------------------------------------------------------------------------- reading, tokenizing
def test_both_formats_read_and_tokenize_as_trl(tok, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [TEXT, CONV])
    text, conv = read_documents([path], task="preference")
    assert text["prompt"] == TEXT["prompt"] and conv["chosen"] == CONV["chosen"] and text["source"].endswith(":1")
    p, c, r = tokenize_pair(tok, text)
    assert tok.decode(c) == " On day 4." + tok.eos_token and tok.decode(r) == " On day 5." + tok.eos_token
    assert tok.decode(p) == TEXT["prompt"]
    p, c, r = tokenize_pair(tok, conv)
    rendered = tok.apply_chat_template(CONV["prompt"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(p) == rendered and tok.decode(c).startswith("On day 3.<|im_end|>")
    trl = pytest.importorskip("trl.data_utils")
    # TRL's own rendering of the conversational pair: prompt with the generation prompt, answers to the turn's end
    strings = trl.maybe_apply_chat_template(CONV, tok)
    assert tok.decode(p) == strings["prompt"] and tok.decode(c) == strings["chosen"]
    assert tok.decode(r) == strings["rejected"]


def test_prepare_rows_schema_one_and_packed(tok, tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [TEXT, CONV])
    triples = [tokenize_pair(tok, x) for x in read_documents([path], task="preference")]
    cache = tmp_path / "cache"
    ds = prepare(path, tok, task="preference", target_tokens=1024, cache_dir=cache)
    assert len(ds) == 2
    for row, triple in zip(ds, triples):
        _check_row(row, [triple])
        assert row["num_loss_tokens"] == len(triple[1]) + len(triple[2])
    (packed,) = prepare(path, tok, task="preference", target_tokens=1024, pack=True, cache_dir=cache)
    _check_row(packed, triples)
    assert packed["position_ids"][packed["branches"][1][0]] == 0, "each pair restarts at 0"
    assert len(packed["doc_ids"]) == len(packed["sources"]) == 2


def test_branch_targets_and_sibling_mask():
    row = shared_prefix_row([([1, 2, 3], [4, 5], [6, 7, 8]), ([9, 10], [11], [12])])
    t = branch_targets(row)
    # pair 0: chosen 3,4 from 2,3; rejected 5,6,7 from 2 (the prompt's last), 5, 6; pair 1 likewise from 9
    assert t.logit_index.tolist() == [2, 3, 2, 5, 6, 9, 9]
    assert t.target_index.tolist() == [3, 4, 5, 6, 7, 10, 11]
    assert t.pair.tolist() == [0, 0, 0, 0, 0, 1, 1] and t.rejected.tolist() == [0, 0, 1, 1, 1, 0, 1]
    next_ids, extra = shifted_targets(row)
    ids = row["input_ids"]
    assert next_ids.tolist() == [IGNORE, IGNORE, ids[3], ids[4], IGNORE, ids[6], ids[7], IGNORE,
                                 IGNORE, ids[10], IGNORE, IGNORE], "chosen's last predicts nothing"
    assert extra.tolist() == [[2, ids[5]], [9, ids[11]]], "rejected's first from the prompt's last position"
    m = sibling_mask(row)
    assert m[5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0], "rejected sees the prompt and itself, not chosen"
    assert m[4].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert not m[8:, :8].any() and not m[:8, 8:].any(), "pairs never see each other"
    assert m[11].tolist()[8:] == [1, 1, 0, 1]


# ------------------------------------------------------------------------------------------- bad rows
BAD = [{"prompt": "P", "chosen": "A"},  # missing field
       {"prompt": "P", "chosen": " same ", "rejected": "same"},  # chosen equals rejected
       {"prompt": "P", "chosen": "A", "rejected": ["B"]}]  # mixed formats


def test_bad_rows_are_named_and_counted(tok, tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [TEXT, *BAD])
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: record has no field 'rejected'"):
        list(read_documents([path], task="preference"))
    skips = Skips()
    assert len(list(read_documents([path], task="preference", skips=skips))) == 1
    assert dict(skips.counts) == {"missing field": 1, "chosen equals rejected": 1, "wrong field type": 1}
    assert "bad.jsonl:3: chosen equals rejected" in skips.report()


def test_prompt_over_target_is_an_error_or_a_counted_skip(tok, tmp_path):
    long = {"prompt": DOC * 4, "chosen": " A", "rejected": " B"}
    almost = {"prompt": DOC, "chosen": " " + "very " * 80 + "long", "rejected": " B"}
    path = _jsonl(tmp_path / "long.jsonl", [long, TEXT, almost])
    n = len(tokenize_pair(tok, TEXT)[0])
    target = max(n + 40, 64)
    with pytest.raises(CorpusError, match=r"long.jsonl:1: the prompt has \d+ tokens, more than the target"):
        prepare(path, tok, task="preference", target_tokens=target, cache_dir=tmp_path / "c")
    skips = Skips()
    ds = prepare(path, tok, task="preference", target_tokens=target, cache_dir=tmp_path / "c", skips=skips)
    assert len(ds) == 1 and ds[0]["sources"][0].endswith(":2")
    assert dict(skips.counts) == {"prompt too long": 1, "pair too long": 1}


def test_cli_prepare_preference_exit_codes(tmp_path, capsys):
    from longdoc.cli import main

    bad = _jsonl(tmp_path / "bad.jsonl", [TEXT, *BAD])
    args = ["data", "prepare", bad, "--task", "preference", "--target-tokens", "1024", "--cache-dir",
            str(tmp_path / "c"), "--out", str(tmp_path / "rows.jsonl")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bad.jsonl:2" in err
    assert main([*args, "--skip-bad"]) == 0
    out = capsys.readouterr()
    assert "wrote 1 rows" in out.out and "skipped 3 bad item(s)" in out.err
    row = json.loads((tmp_path / "rows.jsonl").read_text().splitlines()[0])
    assert {"input_ids", "labels", "position_ids", "branches"} <= set(row)


# ------------------------------------------------------------------------------- the crux: exact log-probs
def _tiny():
    from longdoc import models

    model, _ = models.load("tiny:llama", dtype=torch.float64, attn_implementation="eager")
    return model.eval()


def test_shared_prefix_logps_equal_the_two_sequence_form():
    model = _tiny()
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()

    # two packed pairs of different lengths; the second's rejected is longer than its chosen
    row = shared_prefix_row([(ids(23), ids(7), ids(5)), (ids(11), ids(3), ids(9))])
    mask = additive_mask(sibling_mask(row), torch.float64)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row["input_ids"]]), position_ids=torch.tensor([row["position_ids"]]),
                       attention_mask=mask).logits[0]
        chosen, rejected = pair_logps(logits, row)
        ref = []
        for seq in two_sequence_rows(row):
            out = model(input_ids=torch.tensor([seq["input_ids"]])).logits[0]
            ref.append(sequence_logp(out, seq["labels"]))
    ref = torch.stack(ref).view(-1, 2)
    assert chosen.dtype == torch.float64 and chosen.shape == (2,)
    # float64 throughout, but transformers' eager attention takes its softmax in float32 (modeling_llama's
    # eager_attention_forward): rows of another length round apart at ~1e-8 of sums near 30
    torch.testing.assert_close(chosen, ref[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rejected, ref[:, 1], rtol=0, atol=1e-6)
    # the per-position (shardable) form holds the same predictions: its total equals the pairs' total
    next_ids, extra = shifted_targets(row)
    logp = torch.log_softmax(logits, dim=-1)
    keep = next_ids != IGNORE
    total = logp[keep].gather(-1, next_ids[keep][:, None]).sum() + logp[extra[:, 0], extra[:, 1]].sum()
    torch.testing.assert_close(total, (chosen + rejected).sum(), rtol=0, atol=1e-10)
    # the test can fail: the naive shift (rejected's first token from chosen's last) gives another number
    naive = sum(sequence_logp(logits[p:e], row["labels"][p:e]) for p, c, r, e in row["branches"])
    assert abs(float(naive - (chosen + rejected).sum())) > 1e-3


def test_training_loader_reads_preference_rows_and_refuses_a_mismatch(tok, tmp_path):
    from longdoc.train.config import DataConfig, RecipeError
    from longdoc.train.data import load_sequences

    path = _jsonl(tmp_path / "p.jsonl", [TEXT, CONV])
    cfg = DataConfig(path=path, task="preference", seq_len=1024)
    seqs = load_sequences(cfg, tok, len(tok), seed=0)
    assert len(seqs) == 2 and seqs.has_branches
    assert seqs.ds[0]["branches"].shape == (1, 4)
    rows = tmp_path / "rows.jsonl"
    prepare(path, tok, task="preference", target_tokens=1024, cache_dir=tmp_path / "c").to_json(str(rows))
    with pytest.raises(RecipeError, match="holds preference rows \\(branches\\); set data.task: preference"):
        load_sequences(DataConfig(path=str(rows), task="qa", seq_len=1024), tok, len(tok), seed=0)
    assert load_sequences(DataConfig(path=str(rows), task="preference", seq_len=1024), tok, len(tok), 0).has_branches


def test_train_preflight_accepts_preference_rows_and_refuses_what_dpo_cannot(tmp_path, capsys):
    """The DPO step exists (longdoc.train.dpo): a preference recipe passes the parent's checks; sigmoid DPO without
    LoRA, a simpo margin on the sigmoid loss, a mix and validation are refused in one line with exit 2."""
    import yaml

    from longdoc.cli import main
    from longdoc.train.config import RecipeError, recipe_from_dict
    from longdoc.train.preflight import check_recipe

    path = _jsonl(tmp_path / "p.jsonl", [TEXT])
    base = {"model": {"name": "tiny:llama"}, "output_dir": str(tmp_path / "out"), "lora": {"enabled": True},
            "data": {"path": path, "task": "preference", "seq_len": 1024}}
    check_recipe(recipe_from_dict(base))
    check_recipe(recipe_from_dict(base, ["lora.enabled=false", "preference.loss=simpo", "preference.simpo_gamma=1"]))
    for overrides, needle in ((["lora.enabled=false"], "sigmoid DPO needs lora.enabled"),
                              (["preference.simpo_gamma=1"], "applies to preference.loss=simpo only"),
                              (["preference.loss=orpo"], "preference.loss: must be one of"),
                              (["preference.beta=0"], "preference.beta: must be positive"),
                              (["eval.holdout=1"], "validation computes the SFT loss")):
        with pytest.raises(RecipeError, match=needle):
            recipe_from_dict(base, overrides)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(base))
    assert main(["train", str(recipe), "lora.enabled=false", "--print"], catch=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sigmoid DPO needs lora.enabled" in err[0]
