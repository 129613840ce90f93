"""The lm-eval adapter (`--model longdoc`) against lm-eval's own single-process hf model, on local YAML tasks.

One tiny random model saved to a folder; four local tasks over local jsonl files cover the three request
types: multiple choice and a plain loglikelihood task (loglikelihood, is_greedy), perplexity
(loglikelihood_rolling over several windows) and generation (generate_until with stop sequences).
lm-eval's hf model runs them in this process; the longdoc model runs them at cp=1 here and at cp=2 on two
gloo ranks (requests packed three to a forward). Every per-request log-likelihood, greedy flag and
generated string, and every metric, must match.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.support.distributed import run_ranks  # noqa: E402

TASKS = ["ld_mc", "ld_ll", "ld_ppl", "ld_gen"]
MAX_LENGTH = 384  # every request fits (longdoc refuses, never cuts); the long texts need several rolling windows
LL_TOL = 2e-4  # nats, summed over a continuation (fp32 logits, attention merged in another order)


def _sentences(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    words = "clerk motion hearing filed court witness exhibit record ruling counsel docket order".split()
    return " ".join(f"The {rng.choice(words)} {rng.choice(words)} was noted on day {i}." for i in range(n))


def _write(folder: Path, name: str, rows: list[dict], yaml: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        + yaml)


def _greedy_text(model, tok, text: str, n: int) -> str:
    import torch

    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from longdoc.models import load

    root = tmp_path_factory.mktemp("lmeval")
    os.environ["HF_DATASETS_CACHE"] = str(root / "datasets-cache")  # the spawned ranks inherit it
    model, tok = load("tiny:llama", seed=5)
    model.eval()
    folder = root / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    tasks = root / "tasks"
    tasks.mkdir()
    mc = [{"context": _sentences(n, i), "question": "What was noted first?", "choices": [" a clerk", " the court",
                                                                                          " day zero"],
           "label": i % 3} for i, n in enumerate((2, 9, 20, 5, 28))]
    _write(tasks, "ld_mc", mc, 'output_type: multiple_choice\ndoc_to_text: "{{context}}\\nQuestion: {{question}}\\n'
           'Answer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n'
           '  - metric: acc_norm\n')
    # Continuations the model itself would write next, so is_greedy is True for some requests.
    contexts = [_sentences(n, 10 + n) for n in (3, 12, 25)]
    ll = [{"context": c, "target": _greedy_text(model, tok, c, k)} for c, k in zip(contexts, (1, 2, 3))]
    ll += [{"context": c, "target": " and then the court adjourned"} for c in contexts]
    _write(tasks, "ld_ll", ll, 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\ndoc_to_target: '
           '"{{target}}"\nmetric_list:\n  - metric: perplexity\n  - metric: acc\n')
    ppl = [{"text": _sentences(n, 20 + n)} for n in (4, 40, 90)]  # 1, 2 and 3 windows of MAX_LENGTH
    _write(tasks, "ld_ppl", ppl, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
           'metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n')
    gen = [{"prompt": _sentences(n, 30 + n) + " Next,", "answer": " the"} for n in (2, 15, 30)]
    _write(tasks, "ld_gen", gen, 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: '
           '"{{answer}}"\ngeneration_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n  do_sample: false\n'
           'metric_list:\n  - metric: exact_match\n')
    return {"folder": str(folder), "tasks": str(tasks), "ll_targets": [r["target"] for r in ll]}


def evaluate(model: str, model_args: str, tasks_dir: str) -> dict:
    """simple_evaluate on the four tasks; per task its metrics and every request's responses in doc order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import longdoc.lmeval.model  # noqa: F401 - registers "longdoc"

    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, device="cpu", log_samples=True,
                                  task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                  bootstrap_iters=0)
    out = {}
    for t in TASKS:
        samples = sorted(res["samples"][t], key=lambda s: s["doc_id"])
        metrics = {k: v for k, v in res["results"][t].items() if isinstance(v, (int, float)) and "stderr" not in k}
        out[t] = {"metrics": metrics, "resps": [s["resps"] for s in samples]}
    return out


def _cp2_worker(rank: int, world: int, folder: str, tasks_dir: str) -> dict:
    import lm_eval

    import longdoc.lmeval.model  # noqa: F401
    out = {"cp2": evaluate("longdoc", f"pretrained={folder},cp=2,max_length={MAX_LENGTH},batch_size=3", tasks_dir)}
    model = lm_eval.api.registry.get_model("longdoc")(pretrained=folder, cp=2, max_length=MAX_LENGTH)
    from lm_eval.api.instance import Instance

    def req(text: str) -> Instance:
        return Instance("loglikelihood_rolling", {}, (text,), 0)

    try:  # ranks that hold different requests (a bug in the caller) all get one clear error, never a hang
        model.loglikelihood_rolling([req("one")] + ([req("two")] if rank == 1 else []))
        out["disagree"] = "no error"
    except ValueError as e:
        out["disagree"] = str(e)
    return out


@pytest.fixture(scope="module")
def reference(setup) -> dict:
    return evaluate("hf", f"pretrained={setup['folder']},max_length={MAX_LENGTH},dtype=float32", setup["tasks"])


@pytest.fixture(scope="module")
def cp1(setup) -> dict:
    return evaluate("longdoc", f"pretrained={setup['folder']},max_length={MAX_LENGTH}", setup["tasks"])


@pytest.fixture(scope="module")
def cp2(setup) -> list[dict]:
    return run_ranks(2, _cp2_worker, setup["folder"], setup["tasks"], deadline=900, pg_timeout=120)


def _flat(resps) -> list:
    """Every response of every request: floats, (float, bool) pairs or strings, in order."""
    out = []
    for r in resps:
        if isinstance(r, (list, tuple)) and not (len(r) == 2 and isinstance(r[1], bool)) and not isinstance(r, str):
            out += _flat(r)
        else:
            out.append(tuple(r) if isinstance(r, list) else r)
    return out


def _check_same(got: dict, ref: dict, label: str) -> None:
    for t in TASKS:
        a, b = _flat(got[t]["resps"]), _flat(ref[t]["resps"])
        assert len(a) == len(b) and a, f"{label} {t}: {len(a)} responses, the hf model {len(b)}"
        for x, y in zip(a, b):
            if isinstance(y, str):
                assert x == y, f"{label} {t}: generated {x!r}, the hf model {y!r}"
            elif isinstance(y, tuple):
                assert abs(x[0] - y[0]) < LL_TOL and x[1] == y[1], f"{label} {t}: {x} vs the hf model's {y}"
            else:
                assert abs(x - y) < LL_TOL * 8, f"{label} {t}: rolling log-likelihood {x} vs {y}"
        assert got[t]["metrics"].keys() == ref[t]["metrics"].keys()
        for k, v in ref[t]["metrics"].items():
            assert math.isclose(got[t]["metrics"][k], v, rel_tol=1e-5, abs_tol=1e-6), (label, t, k, v)


def test_cp1_equals_the_hf_model(cp1, reference):
    _check_same(cp1, reference, "cp=1")


def test_cp2_equals_the_hf_model_on_every_rank(cp2, reference):
    for rank, res in enumerate(cp2):
        _check_same(res["cp2"], reference, f"cp=2 rank {rank}")


def test_the_tasks_exercise_what_they_should(reference, setup):
    ll = _flat(reference["ld_ll"]["resps"])
    assert any(greedy for _, greedy in ll) and not all(greedy for _, greedy in ll), ll
    rolling = _flat(reference["ld_ppl"]["resps"])
    assert len(rolling) == 3 and all(x < 0 for x in rolling)
    assert {type(x) for x in _flat(reference["ld_gen"]["resps"])} == {str}


def test_disagreeing_ranks_raise_everywhere(cp2):
    for res in cp2:
        assert "the CP ranks hold different requests" in res["disagree"] and "rank 1: 2 requests" in res["disagree"]


def test_registered_and_declared():
    from importlib.metadata import entry_points

    import lm_eval.api.registry

    from longdoc.lmeval.model import LongDocLM

    assert lm_eval.api.registry.get_model("longdoc") is LongDocLM
    (ep,) = [e for e in entry_points(group="lm_eval.models") if e.name == "longdoc"]
    assert ep.load() is LongDocLM


def test_refusals(setup):
    from lm_eval.api.instance import Instance

    from longdoc.lmeval.model import LongDocLM

    with pytest.raises(ValueError, match="needs 2 processes.*torchrun --nproc_per_node 2"):
        LongDocLM(pretrained=setup["folder"], cp=2)
    with pytest.raises(ValueError, match="not longdoc's"):
        LongDocLM(pretrained=setup["folder"], parallelize=True)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LongDocLM(pretrained="tiny:llama", max_length=1 << 20)
    lm = LongDocLM(pretrained=setup["folder"], max_length=32)
    with pytest.raises(ValueError, match="more than the 33 that max_length=32 leaves.*truncate=true"):
        lm.loglikelihood([Instance("loglikelihood", {}, (_sentences(20, 0), " yes"), 0)])
    cut = LongDocLM(pretrained=setup["folder"], max_length=32, truncate=True)
    assert len(cut.loglikelihood([Instance("loglikelihood", {}, (_sentences(20, 0), " yes"), 0)])) == 1
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\] are not supported"):
        cut.generate_until([Instance("generate_until", {}, ("Hi", {"until": ["."], "num_beams": 2}), 0)])


@pytest.mark.slow
def test_torchrun_command_line_writes_on_global_rank_zero_only(setup, reference, tmp_path):
    """`torchrun --nproc_per_node 2 -m longdoc.lmeval ...`: lm-eval's own command line at cp=2; one results file
    (rank 0's), one printed table, the hf model's scores."""
    import subprocess
    import sys

    out = tmp_path / "out"
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "longdoc.lmeval", "--model", "longdoc",
           "--model_args", f"pretrained={setup['folder']},cp=2,max_length={MAX_LENGTH}", "--device", "cpu",
           "--tasks", "ld_mc,ld_gen", "--include_path", setup["tasks"], "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1, written
    got = json.loads(written[0].read_text())["results"]
    for t in ("ld_mc", "ld_gen"):
        for k, v in reference[t]["metrics"].items():
            assert math.isclose(got[t][k], v, rel_tol=1e-5, abs_tol=1e-6), (t, k)
    assert proc.stdout.count("|ld_mc ") == 1, proc.stdout[-2000:]


def _lmeval(*args: str, cwd: Path):
    """`python -m longdoc.lmeval ARGS` as a user runs it: no launcher."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "longdoc.lmeval", *args], capture_output=True, text=True,
                          timeout=1200, env=env, cwd=cwd)


def test_without_a_launcher_cp2_starts_its_own_ranks(setup, reference, tmp_path):
    """`python -m longdoc.lmeval ... cp=2` with no launcher printed a traceback and exited 1; it starts its two
    local gloo ranks as `longdoc eval --cp 2` does, and writes one results file with the hf model's scores."""
    out = tmp_path / "out"
    proc = _lmeval("--model", "longdoc", "--model_args", f"pretrained={setup['folder']},cp=2,max_length={MAX_LENGTH}",
                   "--device", "cpu", "--tasks", "ld_mc", "--include_path", setup["tasks"], "--output_path", str(out),
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no launcher: starting 2 local CPU processes (cp=2" in proc.stdout, proc.stdout[-2000:]
    written = list(out.rglob("results_*.json"))
    assert len(written) == 1, written  # rank 0's only
    got = json.loads(written[0].read_text())["results"]["ld_mc"]
    for k, v in reference["ld_mc"]["metrics"].items():
        assert math.isclose(got[k], v, rel_tol=1e-5, abs_tol=1e-6), (k, got[k], v)
    assert proc.stdout.count("|ld_mc|") == 1, proc.stdout[-2000:]  # one table: rank 0 prints, rank 1 does not


# one real process per case (about 11 s each): the first in the fast tier, the other two in the slow one
@pytest.mark.parametrize("case", ["missing", pytest.param("context", marks=pytest.mark.slow),
                                  pytest.param("parallelize", marks=pytest.mark.slow)])
def test_without_a_launcher_bad_input_is_one_line_and_exit_2(setup, tmp_path, case):
    margs, says = {"missing": (f"pretrained={tmp_path / 'no-such-model'},cp=2", "no such model folder or file"),
                   "context": (f"pretrained={setup['folder']},cp=2,max_length=1000000",
                               "max_length=1000000 exceeds the model's context"),
                   "parallelize": (f"pretrained={setup['folder']},cp=2,parallelize=true", "not longdoc's")}[case]
    proc = _lmeval("--model", "longdoc", "--model_args", margs, "--device", "cpu", "--tasks", "ld_mc",
                   "--include_path", setup["tasks"], cwd=tmp_path)
    last = proc.stderr.splitlines()[-1] if proc.stderr else ""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (margs, proc.returncode, proc.stderr[-3000:])
    assert last.startswith("python -m longdoc.lmeval: error: ") and says in last, last
