"""Training mixes in one process: the weighted loss and the KL term equal their formulas computed from the full
logits, the token weights follow cp.shard_batch's layout on every rank, the mix order is deterministic with the
configured shares, and recipes refuse what a mix cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.train import recipe_from_dict
from longdoc.train.config import RecipeError
from longdoc.train.data import IGNORE, collate, shard_target_weights, step_denominators
from longdoc.train.loss import LossModel
from longdoc.train.mix import MixSchedule, load_mix
from longdoc.train.modeling import build
from tests.fake_cp import FakeCP
from tests.mix_data import mix_recipe, write_mix_inputs


def _mixed(tmp_path, **kw):
    recipe = recipe_from_dict(mix_recipe(write_mix_inputs(tmp_path / "data"), tmp_path / "out", **kw))
    model, tok = build(recipe.model, recipe.lora, recipe.train, longdoc.ContextParallel(), recipe.data.seq_len)
    seqs = load_mix(recipe.data, tok, model.get_input_embeddings().num_embeddings, recipe.seed, rows_needed=8,
                    model_name=recipe.model.name)
    return recipe, model, tok, seqs


def _perturb(model):
    # adapters, embedding and norm copies away from their initial values, so tuned != base
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def test_weighted_loss_and_kl_equal_the_formula(tmp_path):
    recipe, model, tok, seqs = _mixed(tmp_path)
    _perturb(model)
    model.eval()
    qa, text = 0, seqs.offsets[1]  # a QA row (document weights, KL) and a packed text row
    idx = [qa, qa + 1, text]
    batch = collate(seqs, idx, tok.pad_token_id)
    w, kl = batch.pop("loss_weights"), batch.pop("kl_weights")
    n_w, n_kl = step_denominators(seqs, idx)
    cp = longdoc.ContextParallel()
    local = cp.shard_batch(batch, pad_token_id=tok.pad_token_id)
    lw, lkl = shard_target_weights(batch, w, cp), shard_target_weights(batch, kl, cp)
    shares = {}
    for chunk in (7, 4096):  # chunking never changes the value
        lm = LossModel(model, chunk)
        share, _ = lm(local["input_ids"], local["position_ids"], local["shift_labels"], n_w, loss_weights=lw,
                      kl_weights=lkl, num_kl_tokens=n_kl, cu_seq_lens=local.get("cu_seq_lens_q"))
        shares[chunk] = float(share.detach())
    # the reference: every row on its own through the plain, unpatched model (a packed row: each document alone)
    longdoc.hf.unpatch(model)
    ce_sum, kl_sum, w_sum, kl_count = 0.0, 0.0, 0.0, 0
    for i in idx:
        labels, wr, klr = seqs.targets(i)
        ids = seqs.row(i)[0]
        pos = seqs.position_ids(i)
        starts = [0] + ([int(j) for j in torch.nonzero(pos == 0).flatten() if j > 0] if pos is not None else [])
        for a, b in zip(starts, starts[1:] + [ids.numel()]):
            with torch.no_grad():
                logits = model(input_ids=ids[None, a:b]).logits[0].double()
                with model.disable_adapter():
                    base = model(input_ids=ids[None, a:b]).logits[0].double()
            y, ww, kk = labels[a + 1:b], wr[a + 1:b], klr[a + 1:b]
            keep = y != IGNORE
            ce = F.cross_entropy(logits[:-1][keep], y[keep], reduction="none")
            ce_sum += float((ce * ww[keep]).sum())
            w_sum += float(ww[keep].sum())
            kt = F.kl_div(F.log_softmax(logits[:-1], -1), F.log_softmax(base[:-1], -1), log_target=True,
                          reduction="none").sum(-1)
            kl_sum += float((kt * kk).sum())
            kl_count += int((kk > 0).sum())
    want = ce_sum / w_sum + kl_sum / kl_count
    assert (w_sum, kl_count) == (pytest.approx(n_w, rel=1e-12), n_kl)
    assert kl_sum / kl_count > 1e-3  # the KL term is really there
    for chunk, got in shares.items():
        assert got == pytest.approx(want, rel=2e-5), (chunk, got, want)


@pytest.mark.parametrize("size,layout_name", [(2, "zigzag"), (3, "zigzag"), (2, "contiguous")])
def test_target_weights_follow_the_shard_layout(size, layout_name):
    """Summed over the fake ranks, sum(local weight * local target CE) equals the full-sequence sum, for plain
    and packed rows with right padding: each weight lands with its own target."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (2, 23), generator=g)
    labels = ids.clone()
    labels[0, 20:] = IGNORE  # right padding of row 0
    weights = torch.rand(2, 23, generator=g, dtype=torch.float64) * (labels != IGNORE)
    pos = torch.cat([torch.arange(9), torch.arange(14)]).repeat(2, 1)  # two documents per row
    for batch in ({"input_ids": ids, "labels": labels}, {"input_ids": ids, "labels": labels, "position_ids": pos}):
        token_loss = torch.rand(2, 23, generator=g, dtype=torch.float64)  # a stand-in for CE at each target
        target_of = torch.zeros(2, 23, dtype=torch.long)
        target_of[:, :-1] = torch.arange(1, 23)  # the target at column t is token t + 1
        want = 0.0
        for r in range(2):
            for t in range(22):
                crossing = "position_ids" in batch and int(pos[r, t + 1]) == 0
                if labels[r, t + 1] != IGNORE and not crossing:
                    want += float(weights[r, t + 1] * token_loss[r, t + 1])
        got = 0.0
        for rank in range(size):
            cp = FakeCP(rank, size, layout_name)
            local = longdoc.parallel.batch.shard_batch(batch, cp)
            lw = shard_target_weights(batch, weights, cp)
            src = longdoc.parallel.batch.source_index(batch, cp)
            for r in range(2):
                for j in range(src.shape[1]):
                    c = int(src[r, j])
                    if c >= 0 and local["shift_labels"][r, j] != IGNORE:
                        got += float(lw[r, j] * token_loss[r, c + 1])
                    else:
                        assert float(lw[r, j]) == 0.0 or local["shift_labels"][r, j] != IGNORE
        assert got == pytest.approx(want, rel=1e-12)


def test_mix_schedule_shares_and_determinism():
    s = MixSchedule([5, 3, 7], [2, 1, 1], batch_size=4, micro_batch_size=1, dp_size=2, seed=4)
    counts = s.source_counts(25)
    assert counts == [50, 25, 25]
    again = MixSchedule([5, 3, 7], [2, 1, 1], batch_size=4, micro_batch_size=1, dp_size=2, seed=4)
    assert [s.step_indices(k) for k in range(25)] == [again.step_indices(k) for k in reversed(range(25))][::-1]
    # each source's rows are visited once per pass over that source
    drawn = [i for k in range(25) for i in s.step_indices(k) if 5 <= i < 8]
    assert sorted(drawn[:3]) == [5, 6, 7] and sorted(drawn[3:6]) == [5, 6, 7]
    # the replicas' micro-batches are the step's rows
    step = s.step_indices(3)
    assert sorted(i for d in range(2) for mb in s.micro_batches(3, d) for i in mb) == sorted(step)


def test_mix_recipe_refusals(tmp_path):
    paths = write_mix_inputs(tmp_path / "data")
    rec = mix_recipe(paths, tmp_path / "out")
    with pytest.raises(RecipeError, match="needs lora.enabled"):
        recipe_from_dict({**rec, "lora": {"enabled": False}})
    with pytest.raises(RecipeError, match=r"unknown recipe key data.mix\[1\].wieght .*did you mean data.mix\[1\]"
                                          r".weight"):
        recipe_from_dict(rec, ["data.mix[1].wieght=2"])
    with pytest.raises(RecipeError, match="cannot be combined with data.path"):
        recipe_from_dict(rec, ["data.path=x.jsonl"])
    with pytest.raises(RecipeError, match="document_loss_weight: applies to qa sources only"):
        recipe_from_dict(rec, ["data.mix[1].document_loss_weight=1"])
    with pytest.raises(RecipeError, match="eval.holdout"):
        recipe_from_dict(rec, ["eval.holdout=1"])
    with pytest.raises(RecipeError, match=r"mix has 3 item\(s\), no item \[5\]"):
        recipe_from_dict(rec, ["data.mix[5].weight=1"])
    assert recipe_from_dict(rec, ["data.mix[2].weight=0.25"]).data.mix[2].weight == 0.25


def test_full_fine_tuning_has_no_frozen_base():
    model = longdoc.models.tiny_model("llama")
    with pytest.raises(ValueError, match="needs LoRA"):
        LossModel(model).base()


def test_rehearsal_generates_once_and_caches(tmp_path):
    from longdoc.corpus import rehearsal
    from longdoc.models import load_tokenizer

    tok = load_tokenizer()
    out = tmp_path / "reh.jsonl"
    path = rehearsal.ensure("tiny:llama", tok, samples=3, max_new_tokens=4, seed=1, path=out)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all('"text"' in line for line in lines)
    again = rehearsal.generate("tiny:llama", tok, samples=3, max_new_tokens=4, seed=1)
    import json

    assert [json.loads(line)["text"] for line in lines] == again  # deterministic per seed
    stamp = path.stat().st_mtime_ns
    rehearsal.ensure("tiny:llama", tok, samples=3, max_new_tokens=4, seed=1, path=out)
    assert path.stat().st_mtime_ns == stamp  # cached: not generated again


def test_trained_embeddings_and_norms_export_and_base(tmp_path):
    """lora.train_embeddings / train_norms on a model with a tied lm_head: the exported folder (plain
    transformers) gives the trained model's logits, and with the adapters disabled the model is the original."""
    from transformers import AutoModelForCausalLM

    from longdoc.train.config import LoraConfig, ModelConfig, TrainConfig
    from longdoc.train.modeling import export

    mcfg = ModelConfig(name="tiny:llama", overrides={"tie_word_embeddings": True})
    lcfg = LoraConfig(enabled=True, r=4, train_embeddings=True, train_norms=True)
    model, tok = build(mcfg, lcfg, TrainConfig(), longdoc.ContextParallel(), 64)
    original, _ = build(mcfg, LoraConfig(), TrainConfig(), longdoc.ContextParallel(), 64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("embed_tokens.modules_to_save" in n for n in names) and any("norm.modules_to_save" in n for n in names)
    _perturb(model)
    model.eval()
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None]
    with torch.no_grad():
        tuned = model(input_ids=ids, position_ids=pos).logits
        with model.disable_adapter():
            base = model(input_ids=ids, position_ids=pos).logits
        ref = original.eval()(input_ids=ids, position_ids=pos).logits
    assert torch.equal(base, ref)  # the frozen base is untouched
    assert (tuned - ref).abs().max() > 1e-2  # and the trained copies do change the model
    export(model, tok, tmp_path / "final", merge_lora=True)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    assert loaded.config.tie_word_embeddings
    with torch.no_grad():
        again = loaded(input_ids=ids).logits
    assert (again - tuned).abs().max() <= 1e-5 * tuned.abs().max()
