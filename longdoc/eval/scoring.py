"""Teacher-forced scoring of an answer after a prompt held in a KVSession: NLL and exact-match-by-argmax.

    logits = session.extend(question_ids)[:, -1]       # or session.prefill(prompt_ids)
    mark = session.mark()
    s = answer_score(session, logits, answer_ids)      # one CP forward over the answer tokens
    session.rollback(mark)

Scoring extends the cached prompt by the answer (minus its last token) in one forward: each answer
token's log-probability comes from the logits before it, so the prompt is computed once and shared
with greedy generation and with the other questions about the same document (`score_logits` scores the
logits of several questions' answers computed as one batch, longdoc.hf.branches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longdoc.hf.session import KVSession


@dataclass(frozen=True)
class AnswerScore:
    nll: float  # sum over the answer tokens of -log p(token | everything before it)
    tokens: int
    argmax_match: bool  # every answer token is the argmax of its logits (teacher-forced exact match)
    argmax_tokens: int  # how many answer tokens are the argmax

    @property
    def mean_nll(self) -> float:
        return self.nll / max(self.tokens, 1)


def answer_score(session: KVSession, logits: torch.Tensor, answer_ids: torch.Tensor) -> AnswerScore:
    """Score `answer_ids` (1, n) or (n,) after the tokens so far; `logits` (1, vocab) are those after the
    last of them. Leaves the answer (minus its last token) in the session: roll back afterwards."""
    answer = answer_ids.reshape(1, -1).to(logits.device)
    n = answer.shape[1]
    if n == 0:
        raise ValueError("the answer is empty after tokenization; cannot score it")
    steps = [logits.reshape(1, 1, -1).float()]
    if n > 1:
        steps.append(session.extend(answer[:, :-1], keep=n - 1))
    return score_logits(torch.cat(steps, dim=1)[0], answer[0])


def score_logits(logits: torch.Tensor, answer: torch.Tensor) -> AnswerScore:
    """The score of `answer` (n,) from `logits` (n, vocab), row i the logits that predict answer token i."""
    logp = torch.log_softmax(logits.double(), dim=-1).gather(-1, answer.unsqueeze(-1)).squeeze(-1)
    hits = logits.argmax(dim=-1) == answer
    return AnswerScore(nll=float(-logp.sum()), tokens=int(answer.numel()), argmax_match=bool(hits.all()),
                       argmax_tokens=int(hits.sum()))
