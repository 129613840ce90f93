"""The reader prepare and eval share: what a folder without text files gets told."""

from __future__ import annotations

import pytest

from longdoc.corpus.ingest import CorpusError, read_documents


def _read(path):
    return list(read_documents([str(path)]))


def test_folder_of_extension_less_files_names_them_and_the_rename(tmp_path):
    for name in ("case1", "case2", "notes.v2"):
        (tmp_path / name).write_text("Some text.")
    with pytest.raises(CorpusError, match=r"2 file\(s\) without an extension \(case1, case2\).*give them a "
                                          r"\.txt extension in a copy.*cp .*docs-txt") as e:
        _read(tmp_path)
    assert "Pass data files" not in str(e.value)  # the old advice did not fit
    # the folder may be a system or shared one: the fix copies, it never renames the user's files in place
    assert " mv " not in str(e.value)


def test_folder_of_data_files_says_pass_them_directly(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(CorpusError, match=r"holds data files.*Pass them directly: .*a\.jsonl"):
        _read(tmp_path)


def test_empty_folder_and_other_extensions(tmp_path):
    with pytest.raises(CorpusError, match="it is empty"):
        _read(tmp_path)
    (tmp_path / "scan.png").write_bytes(b"PNG")  # (a .pdf is a document now: tests/unit/test_corpus_documents.py)
    with pytest.raises(CorpusError, match=r"found extensions: \.png.*Convert them"):
        _read(tmp_path)


def test_keep_copies_named_fields(tmp_path):
    rec = {"document": "The fee is 10 mg.", "domain": "medical", "qa": [{"question": "Fee?", "answer": "10 mg",
                                                                         "aliases": ["ten mg"]}]}
    (doc,) = read_documents([rec], task="qa", keep=("domain", "aliases"))
    assert doc["domain"] == "medical" and doc["qas"][0]["aliases"] == ["ten mg"]
    (plain,) = read_documents([rec], task="qa")
    assert "domain" not in plain and "aliases" not in plain["qas"][0]
