"""Self-synthesised rehearsal: text the base model generates itself, generated once and cached, to replay
while fine-tuning (a `data.mix` source `{source: rehearsal}`; `longdoc data rehearse` makes the file ahead).

    longdoc data rehearse --model SmolLM2-135M-Instruct --samples 64 --max-new-tokens 384 --out rehearsal.jsonl

Why it works: the samples are drawn from the base model itself by plain ancestral sampling (temperature 1,
no top-k / top-p), so the LM loss on them is a Monte-Carlo estimate of KL(base || tuned) over whole
sequences, up to a constant: its gradient is zero in expectation at the base, and it pulls the tuned model
back toward what the base would have said. Truncated sampling would bias it toward the base's modes.

With a chat template the prompts are the template's own opening of a user turn (as Magpie does): the model
writes a user request, then (a second generation) its answer, so the rehearsal covers the instruction
format the model was tuned on. Without one, samples start at BOS. Each record is {"doc_id", "text"}.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

_VERSION = 1
_MARK = "\u2063LONGDOC_REHEARSAL\u2063"
BATCH = 16


def default_path(model_name: str, samples: int, max_new_tokens: int, seed: int) -> Path:
    import datasets

    key = hashlib.sha256(json.dumps([_VERSION, model_name, samples, max_new_tokens, seed]).encode()).hexdigest()[:16]
    return Path(datasets.config.HF_DATASETS_CACHE) / "longdoc" / f"rehearsal-{key}.jsonl"


def ensure(model_name: str | None, tokenizer: Any, *, samples: int, max_new_tokens: int, seed: int,
           path: str | Path | None = None, main_first=None) -> Path:
    """The rehearsal file: `path` (or the cache's file for these settings) if it exists, else generated first
    by the main process (the others wait, then read it)."""
    if model_name is None and not (path and Path(path).is_file()):
        raise ValueError("rehearsal needs the model's name to generate with")
    out = Path(path) if path else default_path(str(model_name), samples, max_new_tokens, seed)
    with main_first() if main_first is not None else contextlib.nullcontext():
        if not out.is_file():
            write(generate(model_name, tokenizer, samples=samples, max_new_tokens=max_new_tokens, seed=seed), out)
    return out


def write(texts: list[str], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"doc_id": f"rehearsal-{i}", "text": t}, ensure_ascii=False) + "\n")
    tmp.replace(out)  # the file appears complete or not at all
    return out


def _sample(model, tokenizer, prompts: list[str], max_new_tokens: int, seed: int) -> list[str]:
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(**{k: v.to(model.device) for k, v in enc.items()}, do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    new = out[:, enc["input_ids"].shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


def generate(model_name: str, tokenizer: Any, *, samples: int, max_new_tokens: int, seed: int,
             batch: int = BATCH) -> list[str]:
    """`samples` texts sampled from the (plain, unpatched) model `model_name`."""
    import torch
    from tqdm.auto import tqdm

    from longdoc import models

    model, _ = models.load(model_name)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    chat = bool(getattr(tokenizer, "chat_template", None))
    texts: list[str] = []
    with torch.no_grad():
        for start in tqdm(range(0, samples, batch), desc="rehearsal samples", unit="batch"):
            n = min(batch, samples - start)
            if not chat:
                bos = tokenizer.bos_token or tokenizer.eos_token or ""
                texts += _sample(model, tokenizer, [bos] * n, max_new_tokens, seed + start)
                continue
            opening = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
            opening = opening.split(_MARK)[0]  # the template up to where a user's words begin
            asks = [q or "Hello." for q in _sample(model, tokenizer, [opening] * n, max_new_tokens, seed + start)]
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                     add_generation_prompt=True) for q in asks]
            answers = _sample(model, tokenizer, prompts, max_new_tokens, seed + start + 1)
            texts += [tokenizer.apply_chat_template([{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}], tokenize=False)
                      for q, a in zip(asks, answers)]
    return texts
