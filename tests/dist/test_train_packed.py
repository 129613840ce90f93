"""`longdoc train` on packed rows (several documents per row, `longdoc data prepare --pack`'s format):
cp=2 equals cp=1 over 3 steps, and the documents really are kept apart (dropping the packing changes
the loss)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.support.training import max_rel_err, ranks, tiny_recipe, train_on_ranks

DOC_LENS = [(40, 1, 33, 22), (96,), (7, 60, 29), (50, 46)]  # rows of 96 tokens, one of them a single document


def _packed_dataset(path, with_positions: bool = True) -> str:
    import datasets

    g = torch.Generator().manual_seed(5)
    rows = {"input_ids": [], "labels": [], "position_ids": [], "cu_seqlens": []}
    for lens in DOC_LENS * 3:  # 12 rows
        ids = torch.randint(0, 256, (sum(lens),), generator=g).tolist()
        labels, pos, cuts, start = list(ids), [], [0], 0
        for n in lens:
            labels[start] = -100 if start else labels[start]  # a later document's first token: no target
            pos += list(range(n))
            start += n
            cuts.append(start)
        for key, value in zip(rows, (ids, labels, pos, cuts)):
            rows[key].append(value)
    if not with_positions:
        rows = {"input_ids": rows["input_ids"], "labels": rows["labels"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return str(path)


def test_packed_rows_cp2_equals_cp1(tmp_path):
    data = {"path": _packed_dataset(tmp_path / "packed"), "seq_len": 96}
    ev = {"holdout": 2, "every": 1}  # validation on packed rows runs under the same document masking
    ref, _ = ranks(1, train_on_ranks, tiny_recipe(tmp_path / "cp1", data=data, eval=ev), [], deadline=300)[0]
    cp2 = ranks(2, train_on_ranks, tiny_recipe(tmp_path / "cp2", data=data, eval=ev), ["parallelism.cp_size=2"],
                deadline=300)
    w_ref = load_file(tmp_path / "cp1" / "final" / "model.safetensors")
    w_cp2 = load_file(tmp_path / "cp2" / "final" / "model.safetensors")
    assert max_rel_err(w_cp2, w_ref) <= 1e-5
    for rank_hist, _ in cp2:
        assert len(rank_hist) == len(ref) == 3
        for (step, loss, tokens, _), (rstep, rloss, rtokens, _) in zip(rank_hist, ref, strict=True):
            assert (step, tokens) == (rstep, rtokens)
            assert abs(loss - rloss) <= 1e-5 * max(1.0, abs(rloss)), (step, loss, rloss)
    # the same rows read as one sequence each (documents attending to each other) give another loss
    flat = {"path": _packed_dataset(tmp_path / "flat", with_positions=False), "seq_len": 96}
    joined, _ = ranks(1, train_on_ranks, tiny_recipe(tmp_path / "flat-run", data=flat, eval=ev), [], deadline=300)[0]
    assert abs(joined[0][1] - ref[0][1]) > 1e-4
