"""Evaluation results reused by content (longdoc.eval.cache through tasks.run_suite): a second run of the same model
on the same inputs and settings starts no ranks and writes the same report; a changed model file, input file or
setting is evaluated again."""

from __future__ import annotations

import json

import pytest

from longdoc.eval import cache, runner, tasks


def _data(path, answer: str = "motion 4"):
    doc = " ".join(f"Entry {i}: the clerk filed motion {i * 7 % 31} on day {i}." for i in range(12))
    path.write_text(json.dumps({"id": "d0", "document": doc, "qa": [
        {"id": "q0", "kind": "lookup", "question": "Which motion was filed on day 5?", "answer": answer}]}) + "\n")
    return str(path)


@pytest.fixture()
def counted(monkeypatch):
    """runner.run, counting how many (model, task) pairs each call evaluates."""
    calls: list[list[tuple[str, list[str]]]] = []
    real = runner.run

    def run(fn, cfg):
        calls.append([(m[0], list(m[3])) for m in cfg["suite_models"]])
        return real(fn, cfg)

    monkeypatch.setattr(runner, "run", run)
    return calls


def test_a_second_run_reuses_the_base_and_a_change_runs_again(tmp_path, counted):
    from longdoc.models import load

    folder = tmp_path / "tuned"
    model, tokenizer = load("tiny:llama", seed=3)
    model.save_pretrained(folder)  # a model folder: keyed by its files' content
    tokenizer.save_pretrained(folder)
    data = _data(tmp_path / "qa.jsonl")
    cfg = {"cp": 1, "data": [data], "max_new_tokens": 4, "cache_dir": str(tmp_path / "cache"), "out": "x",
           "threads": 1}
    models = [("base", "tiny:llama"), ("tuned", str(folder))]
    first = tasks.run_suite(models, ["qa"], cfg, tmp_path / "one")
    assert counted == [[("base", ["qa"]), ("tuned", ["qa"])]]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2

    # the same inputs, another output folder and thread count: nothing runs, the reports are the same
    second = tasks.run_suite(models, ["qa"], {**cfg, "out": "y", "threads": 2}, tmp_path / "two")
    assert len(counted) == 1
    for label in ("base", "tuned"):
        a = json.loads((first[label]["qa"] / "results.json").read_text())
        b = json.loads((second[label]["qa"] / "results.json").read_text())
        assert a["rows"] == b["rows"]

    # a new tuned model (one file changed) runs alone; the base is reused
    (folder / "generation_config.json").write_text('{"do_sample": false}\n')
    tasks.run_suite(models, ["qa"], cfg, tmp_path / "three")
    assert counted[-1] == [("tuned", ["qa"])]
    # another data file content, or another setting, runs both again
    _data(tmp_path / "qa.jsonl", answer="day 5")
    tasks.run_suite(models, ["qa"], cfg, tmp_path / "four")
    assert counted[-1] == [("base", ["qa"]), ("tuned", ["qa"])]
    tasks.run_suite(models, ["qa"], {**cfg, "max_new_tokens": 5}, tmp_path / "five")
    assert counted[-1] == [("base", ["qa"]), ("tuned", ["qa"])]
    # --no-cache evaluates again
    tasks.run_suite(models, ["qa"], {**cfg, "cache": False}, tmp_path / "six")
    assert counted[-1] == [("base", ["qa"]), ("tuned", ["qa"])]


def test_keys_follow_content_not_names(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("same")
    b.write_text("same")
    cfg = {"task": "qa", "max_new_tokens": 4}
    assert cache.key("tiny:llama", {**cfg, "data": [str(a)]}) != cache.key("tiny:llama", {**cfg, "data": [str(b)]}), \
        "the file's name is part of the key, as a setting"
    k = cache.key("tiny:llama", {**cfg, "data": [str(a)]})
    assert cache.key("tiny:llama", {**cfg, "data": [str(a)], "out": "elsewhere", "threads": 7}) == k
    a.write_text("changed")
    assert cache.key("tiny:llama", {**cfg, "data": [str(a)]}) != k
    assert cache.key("tiny:qwen3", {**cfg, "data": [str(a)]}) != cache.key("tiny:llama", {**cfg, "data": [str(a)]})
    assert cache.key("some-org/not-on-this-disk", cfg) is None, "a hub id's content is unknown: never cached"
