"""The DPO step on shared-prefix rows in one process, float64: loss, log-probabilities, rewards and every parameter
gradient equal TRL's two-sequence form (prompt+chosen and prompt+rejected as separate rows) at pinned parameters,
for the sigmoid DPO loss (LoRA-disabled reference) and SimPO; and the loss and metrics equal TRL's own code on the
same log-probabilities (TRL 1.16.0: DPOTrainer._compute_loss, CPOTrainer.cpo_loss)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import longdoc
from longdoc.train.dpo import METRICS, metric_sums, metrics_of, pair_targets, preference_losses
from tests.support.dpo_cases import BETA, GAMMA, errors, lora_model, row, shared_prefix, two_sequence


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_shared_prefix_dpo_equals_the_two_sequence_form(loss):
    cp = longdoc.ContextParallel()
    r = row()
    got = shared_prefix(lora_model(cp, dtype=torch.float64), cp, r, loss)
    want = two_sequence(lora_model(cp, dtype=torch.float64, patched=False), r, loss)
    errs = errors(got, want, loss)
    # float64, but the CP attention merges its blocks in fp32 (docs/design.md: ~1e-7)
    assert max(errs.values()) <= 1e-6, errs
    assert float((want["rewards"][0] - want["rewards"][1]).abs().min()) > 1e-3  # the pairs really differ
    if loss == "sigmoid":
        assert float((want["logps"] - want["ref"]).abs().min()) > 1e-3  # policy != reference


def test_every_answer_token_is_predicted_once_and_rejected_first_from_the_prompt():
    r = row()
    t = pair_targets({"input_ids": torch.tensor(r["input_ids"])[None], "branches": [r["branches"]]},
                     longdoc.ContextParallel())
    assert t.lengths.tolist() == [[5, 1], [6, 7]]
    assert int(t.logit.numel()) == 5 + 6 + 1 + 7
    rejected_first = (t.slot == 2 + 0) & (t.token == r["input_ids"][12])
    assert t.logit[rejected_first].tolist() == [6]  # the prompt's last position, not chosen's last (11)


def _trl_dpo(chosen, rejected, ref_c, ref_r, beta):
    """TRL's DPOTrainer._compute_loss on given log-probabilities: a stand-in model whose per-token log-probs sum to
    them, precomputed reference log-probs, the sigmoid loss with label smoothing 0."""
    from trl import DPOTrainer

    n = chosen.numel()
    per_token = torch.zeros(2 * n, 3, dtype=chosen.dtype)
    per_token[:, 0] = torch.cat([chosen, rejected])
    out = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token),
                          mean_logits=torch.zeros_like(per_token), is_top1=torch.zeros_like(per_token, dtype=bool))
    model = SimpleNamespace(training=True)
    fake = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, use_weighting=False, rpo_alpha=None,
        label_smoothing=0.0, _tp_size=1, _total_train_tokens=0, _metrics={"train": defaultdict(list)})
    inputs = {"input_ids": torch.zeros(2 * n, 4, dtype=torch.long), "attention_mask": torch.ones(2 * n, 4),
              "completion_mask": torch.ones(2 * n, 4, dtype=torch.long), "ref_chosen_logps": ref_c,
              "ref_rejected_logps": ref_r}
    loss = DPOTrainer._compute_loss(fake, lambda **kw: out, inputs, False)
    return float(loss), {k: v[-1] for k, v in fake._metrics["train"].items()}


def test_sigmoid_loss_and_metrics_equal_trl():
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    logps, ref = -10 * torch.rand(2, 5, generator=g, dtype=torch.float64), -10 * torch.rand(2, 5, generator=g,
                                                                                             dtype=torch.float64)
    pl = preference_losses(logps, ref, torch.ones(2, 5), "sigmoid", BETA)
    sums = metric_sums(pl).tolist()
    mine = metrics_of(sums, 5)
    trl_loss, trl = _trl_dpo(logps[0], logps[1], ref[0], ref[1], BETA)
    assert sums[0] / 5 == pytest.approx(trl_loss, rel=1e-12)
    for name in METRICS:  # TRL takes the accuracies' mean in float32
        assert mine[name] == pytest.approx(trl[name], rel=1e-7 if "accur" in name else 1e-12), name


def test_simpo_loss_and_rewards_equal_trl_cpo():
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(1)
    logps = -10 * torch.rand(2, 5, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, 9, (2, 5), generator=g).double()
    pl = preference_losses(logps, None, lengths, "simpo", BETA, GAMMA)
    fake = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=GAMMA, beta=BETA, label_smoothing=0.0,
                           accelerator=SimpleNamespace(device="cpu"))
    # TRL averages the log-probabilities over the tokens before (average_log_prob for simpo)
    losses, c, r = CPOTrainer.cpo_loss(fake, logps[0] / lengths[0], logps[1] / lengths[1])
    assert torch.allclose(pl.losses, losses, rtol=1e-12) and torch.allclose(pl.chosen_rewards, c, rtol=1e-12)
    assert torch.allclose(pl.rejected_rewards, r, rtol=1e-12)


def test_a_padded_micro_batch_gives_each_rows_own_sums_and_the_cache_returns_them():
    """Two rows of different lengths (right-padded, as dpo_step.collate_pairs makes them) give the (2, pairs) sums of
    each row run alone; the reference cache hands a row's sums back only when every row of the batch has them."""
    from longdoc.parallel.batch import ROW_LENGTHS
    from longdoc.parallel.batch_branches import BRANCHES
    from longdoc.train.dpo import DpoBatch
    from longdoc.train.dpo_step import ReferenceCache
    from longdoc.train.loss import LossModel

    cp = longdoc.ContextParallel()
    model = lora_model(cp, dtype=torch.float64)
    long, short = row(11), row(12)
    short = {"input_ids": short["input_ids"][:18], "labels": short["labels"][:18], "branches": [short["branches"][0]]}

    def sums(batch):
        local = cp.shard_batch(batch)
        lengths = local.get(ROW_LENGTHS)
        with torch.no_grad():
            _, stats = LossModel(model, 7)(local["input_ids"], local["position_ids"],
                                           cu_seq_lens=local["cu_seq_lens_q"], row_lengths=lengths,
                                           branches=local[BRANCHES],
                                           dpo=DpoBatch(pair_targets(batch, cp), "sigmoid", BETA, 0.0, 3, cp))
        return stats

    def one(r):
        return {"input_ids": torch.tensor(r["input_ids"])[None], "branches": [r["branches"]]}

    ids = torch.zeros(2, 32, dtype=torch.long)
    ids[0], ids[1, :18] = torch.tensor(long["input_ids"]), torch.tensor(short["input_ids"])
    mask = (torch.arange(32) < torch.tensor([[32], [18]])).long()
    both = sums({"input_ids": ids, "attention_mask": mask, "branches": [long["branches"], short["branches"]]})
    alone = torch.cat([sums(one(long)), sums(one(short))], dim=1)
    torch.testing.assert_close(both, alone, rtol=1e-7, atol=1e-7)
    cache = ReferenceCache()
    cache.put([5, 9], [2, 1], both[2:])
    assert cache.get([5, 7]) is None and torch.equal(cache.get([9, 5]), both[2:][:, [2, 0, 1]])
    assert ReferenceCache(enabled=False).get([5]) is None
