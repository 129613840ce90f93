"""QA on real, hard-wrapped text: answers and evidence found up to case and whitespace (with the document's own
span), scoring that ignores whitespace, and `longdoc eval qa --skip-bad`."""

from __future__ import annotations

import json

import pytest

from longdoc.corpus.ingest import CorpusError, Skips, find_text, read_documents
from longdoc.eval import metrics

WRAPPED = ("THIS AGREEMENT is made between ACME Ltd, whose principal\nplace of  business is 1 Mill Lane, Leeds,\n"
           "and Beta LLP (the Customer).")


def _qa(answer, **extra):
    return {"document": WRAPPED, "qa": [{"question": "Where is ACME's principal place of business?",
                                         "answer": answer, **extra}]}


def test_answer_across_a_line_break_is_found_with_the_documents_span():
    (rec,) = read_documents([_qa("Principal place of business")], task="qa")
    (a, b), = rec["qas"][0]["spans"]
    assert WRAPPED[a:b] == "principal\nplace of  business"


def test_answer_copied_with_its_line_break_is_one_line():
    (rec,) = read_documents([_qa("1 Mill Lane,\n Leeds")], task="qa")
    qa = rec["qas"][0]
    assert qa["answer"] == "1 Mill Lane, Leeds"  # the training / scoring target has no line break
    assert WRAPPED[slice(*qa["spans"][0])] == "1 Mill Lane, Leeds"


def test_evidence_given_as_text_or_with_text_that_wraps():
    (rec,) = read_documents([_qa("Leeds", evidence=["whose principal place of business is 1 Mill Lane"])], task="qa")
    assert WRAPPED[slice(*rec["qas"][0]["spans"][0])].startswith("whose principal\nplace")
    start = WRAPPED.index("principal")
    end = WRAPPED.index("business") + len("business")
    (rec,) = read_documents([_qa("x", evidence=[{"start": start, "end": end,
                                                  "text": "Principal place of business"}])], task="qa")
    assert rec["qas"][0]["spans"] == [[start, end]]
    with pytest.raises(CorpusError, match=r"evidence\[0\] text 'place of residence' not found"):
        list(read_documents([_qa("Leeds", evidence=[{"text": "place of residence"}])], task="qa"))


def test_find_text():
    assert find_text("a\tB  c d", "b c") == (2, 6)
    assert find_text("abc", "  ") is None and find_text("abc", "x") is None
    assert find_text("x. Dr. Who; Dr.  Who", "dr. who", start=3) == (3, 10)


@pytest.mark.parametrize("prediction", ["principal\nplace of business", "Principal place\u200bof business",
                                        "princi\u00adpal place of  busi\u00adness"])
def test_scoring_ignores_whitespace_and_invisible_characters(prediction):
    gold = "principal place of business"
    assert metrics.exact_match(prediction, gold) == 1.0
    assert metrics.token_f1(prediction, gold) == 1.0 and metrics.contains_answer(prediction, gold) == 1.0


def _qa_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    lines = [_qa("principal place of business"),                           # crosses a line break: evaluates
             {"document": WRAPPED, "question": "Who signs?", "answer": "Gamma GmbH"},  # not in the document
             {"document": "", "question": "Q?", "answer": "A"}]                       # empty document
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_eval_read_records_skip_bad(tmp_path):
    from longdoc.eval import qa

    path = _qa_file(tmp_path)
    with pytest.raises(CorpusError, match=r"qa\.jsonl:2: answer 'Gamma GmbH' not found"):
        qa.read_records(path)
    skips = Skips()
    (rec,) = qa.read_records(path, skips=skips)
    assert skips.counts == {"answer not found": 1, "empty document": 1}
    qa.check({"data": [str(path)], "skip_bad": True})
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"document": "", "question": "Q?", "answer": "A"}) + "\n")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:1: field 'document' is empty"):
        qa.check({"data": [str(only_bad)]})
    with pytest.raises(ValueError, match=r"bad\.jsonl: no usable record \(skipped 1 bad item"):
        qa.check({"data": [str(only_bad)], "skip_bad": True})


def test_eval_qa_cli_skip_bad_reports_what_it_skipped(tmp_path, capsys):
    from longdoc.cli import main
    from longdoc.eval import report

    path = _qa_file(tmp_path)
    common = ["eval", "qa", "--model", "tiny:llama", "--threads", "1", "--data", str(path), "--max-new-tokens", "2"]
    assert main([*common, "--out", str(tmp_path / "a")], catch=True) == 2
    assert "qa.jsonl:2: answer 'Gamma GmbH' not found" in capsys.readouterr().err
    assert main([*common, "--skip-bad", "--out", str(tmp_path / "b")], catch=True) == 0
    out = capsys.readouterr().out
    assert "over 1 questions; skipped 2 bad item(s): 1 answer not found, 1 empty document" in out
    res = report.load_results(tmp_path / "b")
    assert res["skipped"]["by_reason"] == {"answer not found": 1, "empty document": 1}
    assert res["rows"][0]["answer"] == "principal place of business"
    assert "skipped 2 bad item(s)" in (tmp_path / "b" / "summary.md").read_text()
