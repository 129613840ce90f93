"""`lm_eval --model longdoc`: lm-evaluation-harness requests served with CP prefill and sharded-KV decoding.

    torchrun --nproc_per_node 2 -m longdoc.lmeval --model longdoc --device cpu \\
        --model_args pretrained=SmolLM2-135M-Instruct,cp=2 --tasks my_task --include_path my_tasks/

model_args: pretrained (a name, folder, .gguf, hub id or tiny:<arch>; default the offline SmolLM2), cp (the
number of processes: every process is one CP rank), strategy (ring | allgather), layout, dtype, batch_size
(at most this many requests packed into one CP forward for the log-likelihoods), max_batch_tokens (at most
this many tokens in that forward's row; default max_length, so a packed row is never longer than one request
may be), max_length (default: the model's context), max_gen_toks, truncate (default false: a request longer
than max_length is refused, never cut; true cuts from the left as lm-eval's hf model does), add_bos_token,
prefix_token_id, rope_type/rope_factor. lm-eval's --device (default cuda:0) picks cpu or cuda; on CUDA every
rank takes its LOCAL_RANK's GPU.

Every CP rank serves the same request stream: lm-eval is told this is ONE process (rank 0 of 1), so it
neither splits the requests nor gathers across ranks; the ranks check that they hold the same requests
(a digest, before any compute) and stay in lock-step through every forward and decoding step, rank 0's
choice of each token being every rank's. `python -m longdoc.lmeval` writes results on global rank 0 only.

Scoring follows lm-eval's hf model (lm_eval.models.huggingface.HFLM) request by request: the same
tokenization (context/continuation split, the prefix token for an empty context, add_bos_token), the same
rolling windows (lm_eval.utils.get_rolling_token_windows) and the same stop-sequence handling; the test
(tests/dist/test_lmeval.py) runs a local task through both and compares every log-likelihood and score.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

import longdoc
from longdoc.eval import runner
from longdoc.hf.decode import Sampler
from longdoc.hf.prefill import target_scores
from longdoc.hf.session import KVSession
from longdoc.parallel import comm
from longdoc.runtime.launch import launched_world, process_group

__all__ = ["LongDocLM"]


def pack(lengths: list[int], items: list[Any], max_items: int, max_tokens: int) -> list[list[Any]]:
    """`items` (of `lengths` tokens) in order, cut into rows of at most `max_items` items and `max_tokens` tokens
    (an item longer than max_tokens alone in its row)."""
    rows: list[list[Any]] = []
    tokens = 0
    for n, item in zip(lengths, items):
        if not rows or len(rows[-1]) >= max_items or tokens + n > max_tokens:
            rows.append([])
            tokens = 0
        rows[-1].append(item)
        tokens += n
    return rows


def _bool(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"expected true or false, got {value!r}")
    return text in ("true", "1", "yes")


@register_model("longdoc")
class LongDocLM(TemplateLM):
    """An lm-eval model whose every forward is a context-parallel one (see the module docstring)."""

    def __init__(self, pretrained: str = "SmolLM2-135M-Instruct", cp: int = 1, strategy: str = "ring",
                 layout: str = "zigzag", dtype: str = "float32", batch_size: int | str | None = 1,
                 max_length: int | None = None, max_gen_toks: int = 256, truncate: bool | str = False,
                 add_bos_token: bool | str | None = None, prefix_token_id: int | None = None,
                 device: str | None = None, timeout: float = 1800, rope_type: str | None = None,
                 rope_factor: float | None = None, max_batch_size: int | None = None,
                 max_batch_tokens: int | None = None, **unused: Any):
        super().__init__()
        if unused:
            raise ValueError(f"model_args {sorted(unused)} are not longdoc's; it takes pretrained, cp, strategy, "
                             f"layout, dtype, batch_size, max_batch_tokens, max_length, max_gen_toks, truncate, "
                             f"add_bos_token, prefix_token_id, device, timeout, rope_type, rope_factor")
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by longdoc; give the number of requests packed into "
                             "one CP forward (e.g. batch_size=8)")
        self.cp_size, self.strategy, self.batch = int(cp), strategy, max(1, int(batch_size or 1))
        self.truncate, self.add_bos_token = bool(_bool(truncate)), _bool(add_bos_token)
        self.custom_prefix_token_id = None if prefix_token_id is None else int(prefix_token_id)
        want = {"cuda": "cuda", "cpu": "cpu", None: "auto", "auto": "auto"}.get(
            device.split(":")[0] if isinstance(device, str) else device, "auto")
        self._exit = contextlib.ExitStack()
        launch = launched_world()
        if launch.launched:
            if launch.world_size != self.cp_size:
                raise ValueError(f"launched with {launch.world_size} processes but cp={self.cp_size}: every process "
                                 f"is one CP rank of one request stream; pass cp={launch.world_size} (or launch "
                                 f"{self.cp_size} processes)")
            self._exit.enter_context(process_group("gloo" if want == "cpu" else None, timeout=float(timeout)))
            atexit.register(self._exit.close)
        elif self.cp_size > 1:
            raise ValueError(f"cp={self.cp_size} needs {self.cp_size} processes, one per CP rank: run `torchrun "
                             f"--nproc_per_node {self.cp_size} -m longdoc.lmeval --model longdoc ...` (or `accelerate "
                             f"launch --multi_gpu --num_processes {self.cp_size} -m longdoc.lmeval ...`)")
        cfg = {"device": want, "dtype": dtype, "rope_type": rope_type, "rope_factor": rope_factor}
        self._device = runner.device_for(cfg, launch.launched)
        self.cp = longdoc.ContextParallel(layout=layout, timeout=float(timeout))
        self.model, self.tokenizer = runner.load_model(str(pretrained), cfg, self._device)
        longdoc.patch(self.model, self.cp, strategy=strategy)
        self.pretrained = str(pretrained)
        limit = self.model.config.get_text_config().max_position_embeddings
        self._max_length = int(max_length) if max_length is not None else int(limit)
        runner.check_context(self.model, self._max_length, f"max_length={self._max_length}")
        self.max_batch_tokens = self._max_length if max_batch_tokens is None else int(max_batch_tokens)
        if self.max_batch_tokens < self._max_length:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} is below max_length={self._max_length}: one "
                             f"request alone may hold max_length tokens; raise max_batch_tokens or lower max_length")
        self._max_gen_toks = int(max_gen_toks)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        self.stop_ids = sorted({*([eos] if isinstance(eos, int) else eos or []), self.tokenizer.eos_token_id} - {None})

    # ---- what lm-eval reads ----

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": self.pretrained, "cp": self.cp.size, "strategy": self.strategy,
                "model_dtype": str(next(self.model.parameters()).dtype)}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """As lm-eval's hf model encodes (its add_bos_token and BOS-prefix rules), so the ids are the same."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # ---- lock-step ----

    def _agree(self, kind: str, items: Iterable[Any]) -> None:
        """Every CP rank holds the same requests, checked with a digest before any compute, or all raise."""
        if self.cp.size == 1:
            return
        items = list(items)
        digest = int(hashlib.sha1(repr(items).encode()).hexdigest()[:15], 16)
        metas = comm.agree([len(items), digest], self.cp.group, self.cp.timeout, self.cp.comm_device(self._device))
        if any(m != metas[0] for m in metas):
            raise ValueError(f"longdoc {kind}: the CP ranks hold different requests "
                             f"({'; '.join(f'rank {r}: {m[0]} requests' for r, m in enumerate(metas))}); every rank "
                             f"must read the same task data in the same order (same files, seeds and arguments)")

    def _fit(self, ids: list[int], room: int, what: str) -> list[int]:
        if len(ids) <= room:
            return ids
        if self.truncate:
            return ids[-room:]  # lm-eval's hf model: cut from the left
        raise ValueError(f"longdoc: {what} has {len(ids)} tokens, more than the {room} that max_length="
                         f"{self.max_length} leaves; raise max_length (up to the model's context), extend the "
                         f"context (rope_type=yarn,rope_factor=2), or pass truncate=true to cut from the left as "
                         f"lm-eval's hf model does")

    # ---- log-likelihoods ----

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              ) -> list[tuple[float, bool]]:
        self._agree("loglikelihood", [(c, x) for _, c, x in requests])
        prepared = []
        for key, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("longdoc: a loglikelihood request needs a context and a continuation of >= 1 token")
            full = self._fit(context + continuation, self.max_length + 1, "a loglikelihood request")
            prepared.append((key, full[:-1], continuation))
        # Longest first (as lm-eval's hf model), up to `batch_size` requests and `max_batch_tokens` tokens packed
        # into one row per CP forward.
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][1]))
        out: list[tuple[float, bool] | None] = [None] * len(prepared)
        bar = tqdm(total=len(order), disable=disable_tqdm or self.cp.rank != 0, desc="longdoc loglikelihood")
        for chunk in pack([len(prepared[i][1]) for i in order], order, self.batch, self.max_batch_tokens):
            for i, score in zip(chunk, self._score_packed([prepared[i] for i in chunk])):
                out[i] = score
                if prepared[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", prepared[i][0], score)
            bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    def _score_packed(self, chunk: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One CP forward over the inputs of `chunk` packed into one row (position ids restart per request, so
        each attends only to itself), scoring each continuation at the positions that predict it."""
        ids, positions, pos, targets, spans = [], [], [], [], []
        for _, inp, cont in chunk:
            start = len(ids)
            ids += inp
            positions += range(len(inp))
            pos += range(start + len(inp) - len(cont), start + len(inp))
            targets += cont
            spans.append((len(targets) - len(cont), len(targets)))
        batch = {"input_ids": torch.tensor([ids], device=self._device)}
        if len(chunk) > 1:
            batch["position_ids"] = torch.tensor([positions], device=self._device)
        logp, greedy = target_scores(self.model, self.cp, batch, torch.tensor([pos], device=self._device),
                                     torch.tensor([targets], device=self._device),
                                     pad_token_id=self.tokenizer.pad_token_id or 0)
        return [(float(logp[0, a:b].double().sum()), bool(greedy[0, a:b].all())) for a, b in spans]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        self._agree("loglikelihood_rolling", [r.args for r in requests])
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True) if windows else []
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # ---- generation ----

    def _encode_prompt(self, text: str) -> list[int]:
        """A generation prompt as lm-eval's hf model encodes it (tok_batch_encode's rules for one string)."""
        special: dict[str, bool] = {}
        if has_bos_prefix(text, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        return list(self.tokenizer(text, **special)["input_ids"])

    def _stopper(self, until: list[str]):
        """Rows whose generated text holds a stop sequence (lm-eval's hf model checks the same text; the cut
        at the first stop sequence comes after decoding)."""
        def stopped(tokens: torch.Tensor) -> torch.Tensor:
            texts = self.tokenizer.batch_decode(tokens.tolist())
            return torch.tensor([any(s and s in t for s in until) for t in texts])
        return stopped

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        self._agree("generate_until", [r.args for r in requests])
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        jobs = []
        for request in requests:  # every request checked before any compute
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = kwargs.pop("max_gen_toks")
            extra = sorted(set(kwargs) - {"do_sample", "temperature", "top_p", "top_k"})
            if extra:  # lm-eval's hf model would hand them to model.generate; ignoring them would change the answer
                raise ValueError(f"longdoc: generation_kwargs {extra} are not supported (CP decoding is greedy, or "
                                 f"samples with temperature, top_k and top_p); drop them from the task's "
                                 f"generation_kwargs or --gen_kwargs")
            if self.max_length - max_new < 1:
                raise ValueError(f"longdoc: max_gen_toks={max_new} leaves no room for a prompt in max_length="
                                 f"{self.max_length}")
            ids = self._fit(self._encode_prompt(context), self.max_length - max_new, "a generation prompt")
            sampler = Sampler(bool(kwargs.get("do_sample")), float(kwargs.get("temperature") or 1.0),
                              float(kwargs.get("top_p") or 1.0), kwargs.get("top_k"))
            jobs.append((request, ids, until, max_new, sampler))
        out = []
        for request, ids, until, max_new, sampler in tqdm(jobs, disable=disable_tqdm or self.cp.rank != 0,
                                                         desc="longdoc generate_until"):
            with KVSession(self.model, self.cp, strategy=self.strategy) as session:
                logits = session.prefill(torch.tensor([ids], device=self._device))
                gen = session.decode(logits, max_new, self.stop_ids, sampler, stop=self._stopper(until))
            text = postprocess_generated_text(self.tokenizer.decode(gen.tokens[0].tolist(), skip_special_tokens=True),
                                              until, None)
            out.append(text)
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out
