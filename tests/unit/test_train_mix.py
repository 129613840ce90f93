"""Training mixes in one process: the weighted loss and the KL term equal their formulas computed from the full
logits, the token weights follow cp.shard_batch's layout on every rank, the mix order is deterministic with the
configured shares, drawn context positions (context_positions) keep the step's totals and estimate the full terms
without bias, and recipes refuse what a mix cannot do."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import longdoc
from longdoc.train import recipe_from_dict
from longdoc.train.config import RecipeError
from longdoc.train.data import IGNORE, collate, draw_context, shard_target_weights, step_denominators
from longdoc.train.loss import LossModel
from longdoc.train.mix import MixSchedule, load_mix
from longdoc.train.modeling import build
from tests.support.fake_cp import FakeCP
from tests.support.mix_data import mix_recipe, write_mix_inputs


def _mixed(tmp_path, **kw):
    recipe = recipe_from_dict(mix_recipe(write_mix_inputs(tmp_path / "data"), tmp_path / "out", **kw))
    model, tok = build(recipe.model, recipe.lora, recipe.train, recipe.parallelism, longdoc.ContextParallel(),
                       recipe.data.seq_len)
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


@pytest.mark.parametrize("context_positions", [None, 8])
def test_weighted_loss_and_kl_equal_the_formula(tmp_path, context_positions):
    """With context_positions the formula is taken over the drawn targets of one step, over the step's full
    denominators (every context token)."""
    recipe, model, tok, seqs = _mixed(tmp_path, context_positions=context_positions)
    _perturb(model)
    model.eval()
    step = None if context_positions is None else 3
    qa, text = 0, seqs.offsets[1]  # a QA row (document weights, KL) and a packed text row
    idx = [qa, qa + 1, text]
    batch = collate(seqs, idx, tok.pad_token_id, step)
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
        labels, wr, klr = seqs.targets(i, step)
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
    want = ce_sum / n_w + kl_sum / n_kl
    assert (w_sum, kl_count) == (pytest.approx(n_w, rel=1e-12), n_kl if step is None else 3 * context_positions)
    assert kl_sum / kl_count > 1e-3  # the KL term is really there
    for chunk, got in shares.items():
        assert got == pytest.approx(want, rel=2e-5), (chunk, got, want)


def _counted(seqs, i: int, kl: torch.Tensor) -> torch.Tensor:
    # the context positions the step's KL count holds: KL weight > 0, not the first token nor a packed document's
    context = kl > 0
    context[0] = False
    pos = seqs.position_ids(i)
    if pos is not None:
        context[1:] &= pos[1:] != 0
    return context


def test_context_positions_keep_the_totals_and_the_answers(tmp_path):
    """context_positions=8: the document loss and the KL at 8 drawn context positions per row, each weighted N / 8;
    the step's sum(w) and sum(k) are kept (to float64 rounding; the denominators still count every context token),
    the answers and a text row's own targets are untouched, undrawn document tokens are no target at all (label
    -100: the head never computes them), and the draw is a pure function of (seed, source, row, step)."""
    recipe, model, tok, seqs = _mixed(tmp_path, context_positions=8)
    qa, text = 0, seqs.offsets[1]
    for i in (qa, qa + 1, text):
        labels, w, kl = seqs.targets(i)  # every context token
        s_labels, s_w, s_kl = seqs.targets(i, 3)  # optimizer step 3's draw
        context = _counted(seqs, i, kl)
        drawn = context & (s_kl > 0)
        n = int(context.sum())
        assert n > 8 and int(drawn.sum()) == 8, (i, n)
        assert torch.equal(s_kl[drawn], kl[drawn] * (n / 8)) and not s_kl[context & ~drawn].any()
        assert float(s_kl[context].sum()) == pytest.approx(float(kl[context].sum()), rel=1e-12)
        # everything else, the answers of a QA row included, exactly as without a draw
        assert torch.equal(s_labels[~context], labels[~context]) and torch.equal(s_w[~context], w[~context])
        if i == text:  # an LM row: its own targets keep their CE at every token, only the KL is drawn
            assert torch.equal(s_labels, labels) and torch.equal(s_w, w)
        else:
            assert (labels[context] != IGNORE).all() and torch.equal(s_labels[drawn], labels[drawn])
            assert (s_labels[context & ~drawn] == IGNORE).all() and not s_w[context & ~drawn].any()
            assert float(s_w[context].sum()) == pytest.approx(float(w[context].sum()), rel=1e-12)
            assert (s_labels[~context] != IGNORE).sum() > 0  # the answers are there
        again = seqs.targets(i, 3)
        assert all(torch.equal(a, b) for a, b in zip(again, (s_labels, s_w, s_kl)))
        assert not torch.equal(seqs.targets(i, 4)[2] > 0, drawn)  # each step draws anew
    assert not torch.equal(seqs.targets(qa, 3)[2] > 0, seqs.targets(qa + 1, 3)[2] > 0)  # and each row
    # through collate and the CP layout: the loss weights sum to the step's denominator, the KL weights to the full
    # KL weights' sum, at 8 positions per row of the n_kl the step's KL term divides by
    idx = [qa, qa + 1, text]
    n_w, n_kl = step_denominators(seqs, idx)
    cp = longdoc.ContextParallel()
    full, sampled = collate(seqs, idx, tok.pad_token_id), collate(seqs, idx, tok.pad_token_id, 3)
    lw = shard_target_weights(sampled, sampled["loss_weights"], cp)
    lkl = shard_target_weights(sampled, sampled["kl_weights"], cp)
    assert float(lw.sum()) == pytest.approx(n_w, rel=1e-12)
    assert float(lkl.sum()) == pytest.approx(float(shard_target_weights(full, full["kl_weights"], cp).sum()), rel=1e-12)
    assert int((lkl > 0).sum()) == 3 * 8 < n_kl


def test_draw_context_is_uniform_and_unbiased():
    """Over many (row, step) keys every counted position is drawn with probability n / N, so the factor-weighted
    sum of fixed per-token values averages to their full sum; in every draw the factors sum to N (to float64
    rounding) and leave the other positions alone; a row with at most n counted positions keeps all of them."""
    g = torch.Generator().manual_seed(0)
    counted = torch.rand(64, generator=g) < 0.8
    counted[0] = False
    values = torch.rand(64, generator=g, dtype=torch.float64)  # a stand-in for each token's CE or KL
    total, n, draws = int(counted.sum()), 7, 20_000
    seen = torch.zeros(64, dtype=torch.float64)
    estimates = torch.zeros(draws, dtype=torch.float64)
    for k in range(draws):
        f = draw_context(counted, n, (5, 1, k // 100, k % 100))  # (seed, source, row, step)
        assert int((f[counted] > 0).sum()) == n and bool((f[~counted] == 1).all())
        assert float(f[counted].sum()) == pytest.approx(total, rel=1e-12)
        seen += (f > 0) & counted
        estimates[k] = (f * values)[counted].sum()
    assert torch.equal(draw_context(counted, n, (5, 1, 2, 3)), draw_context(counted, n, (5, 1, 2, 3)))
    p = n / total
    assert float((seen[counted] / draws - p).abs().max()) < 5 * math.sqrt(p * (1 - p) / draws)
    # n of N without replacement: the estimate's standard deviation is N * std(values) * sqrt((1 - n / N) / n)
    spread = total * float(values[counted].std()) * math.sqrt((1 - p) / n)
    err = abs(float(estimates.mean()) - float(values[counted].sum()))
    assert err < 4 * spread / math.sqrt(draws), (err, spread / math.sqrt(draws))
    assert torch.equal(draw_context(counted, total, (0,)), torch.ones(64, dtype=torch.float64))


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
    for bad in ("data.mix[0].context_positions=0", "data.mix[1].context_positions=-4",
                "data.mix[2].context_positions=16"):  # the rehearsal source has neither a document loss nor KL
        with pytest.raises(RecipeError, match=r"data\.mix\.context_positions: must be null \(every context token\) "
                                              r"or a positive count .* got (0|-4|16)$") as e:
            recipe_from_dict(rec, [bad])
        assert "\n" not in str(e.value)
    assert recipe_from_dict(rec, ["data.mix[0].context_positions=1k"]).data.mix[0].context_positions == 1024
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

    from longdoc.train.config import LoraConfig, ModelConfig, ParallelismConfig, TrainConfig
    from longdoc.train.modeling import export

    mcfg = ModelConfig(name="tiny:llama", overrides={"tie_word_embeddings": True})
    lcfg = LoraConfig(enabled=True, r=4, train_embeddings=True, train_norms=True)
    model, tok = build(mcfg, lcfg, TrainConfig(), ParallelismConfig(), longdoc.ContextParallel(), 64)
    original, _ = build(mcfg, LoraConfig(), TrainConfig(), ParallelismConfig(), longdoc.ContextParallel(), 64)
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
