"""Small training-mix inputs the mix tests share: QA documents, short plain texts and a rehearsal file.

Every document is made of random words with a planted fact, so the rows are short (a tiny model trains on
them in seconds) and the QA answers are found in the text (the reader computes their evidence spans).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("court motion filed clerk exhibit witness counsel hearing order record notice appeal docket judge "
         "party claim damages contract lease tenant payment schedule invoice ledger audit").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_mix_inputs(root: Path, docs: int = 4, seed: int = 0) -> dict[str, str]:
    """{qa, text, rehearsal} paths under root: QA documents (jsonl), a folder of short .txt files, and a
    rehearsal jsonl (as `longdoc data rehearse` writes) so no test generates."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    qa = root / "qa.jsonl"
    with open(qa, "w") as f:
        for d in range(docs):
            code, name = rng.randrange(1000, 9999), rng.choice(["Ames", "Brook", "Cole", "Dunn"])
            text = (f"{_words(rng, 40)}. The docket code is {code}. {_words(rng, 30)}. "
                    f"The presiding judge is {name}. {_words(rng, 30)}.")
            f.write(json.dumps({"doc_id": f"d{d}", "document": text,
                                "qa": [{"question": "What is the docket code?", "answer": str(code)},
                                       {"question": "Who is the presiding judge?", "answer": name}]}) + "\n")
    text = root / "text"
    text.mkdir(exist_ok=True)
    for t in range(6):
        (text / f"t{t}.txt").write_text(_words(rng, 10 + 7 * t) + ".\n")
    reh = root / "rehearsal.jsonl"
    with open(reh, "w") as f:
        for t in range(5):
            f.write(json.dumps({"doc_id": f"rehearsal-{t}", "text": _words(rng, 12 + 5 * t)}) + "\n")
    return {"qa": str(qa), "text": str(text), "rehearsal": str(reh)}


def mix_recipe(paths: dict[str, str], out, kl: float = 0.5, document: float = 0.3,
               context_positions: int | None = None) -> dict:
    """A tiny-model LoRA recipe over every source kind: QA rows with document loss and KL, packed plain text
    with its own loss weight and KL, packed rehearsal; embeddings (tied with lm_head) and norms trained beside
    the adapters. context_positions: set on the QA and the text source (their document loss / KL drawn)."""
    from tests.support.training import tiny_recipe

    mix = [{"source": "qa", "path": paths["qa"], "weight": 2, "document_loss_weight": document, "kl_weight": kl},
           {"source": "text", "path": paths["text"], "weight": 1, "pack": True, "loss_weight": 0.5,
            "kl_weight": kl / 2},
           {"source": "rehearsal", "path": paths["rehearsal"], "weight": 1, "pack": True}]
    if context_positions is not None:
        for src in mix[:2]:
            src["context_positions"] = context_positions
    return tiny_recipe(out, model={"name": "tiny:llama", "overrides": {"tie_word_embeddings": True}},
                       lora={"enabled": True, "r": 4, "train_embeddings": True, "train_norms": True},
                       data={"path": "", "seq_len": 256, "mix": mix},
                       # lr 1e-2: the adapters move enough in 3 steps that the KL term is far from 0. Runs compared
                       # step by step are pinned to one parameter trajectory (tests/support/training.py: train_pinned)
                       optim={"lr": 1e-2},
                       train={"steps": 3, "batch_size": 2, "loss_chunk_tokens": 64, "mixed_precision": "no"})


class _Stop(Exception):
    pass


def train_stopped_at(rank: int, world_size: int, recipe: dict, overrides: list[str], stop: int):
    """Train until step `stop` is done but before its checkpoint is written (on_step runs first), then stop;
    return the steps taken."""
    from tests.support.training import accelerate_env

    accelerate_env(rank, world_size)
    from longdoc.train import recipe_from_dict
    from longdoc.train.loop import train

    steps = []

    def on_step(info):
        if info.step == stop:
            raise _Stop
        steps.append(info.step)

    try:
        train(recipe_from_dict(recipe, overrides), on_step=on_step)
    except _Stop:
        pass
    return steps
