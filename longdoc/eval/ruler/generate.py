"""The eight tasks of the RULER-style suite (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"): how each sample is generated. docs/ruler.md says the same in prose,
with the scoring and where this differs from RULER.

    sample = make("niah_multikey", length=4096, index=7, seed=0, haystack="prose", builder=Builder(tok))
    sample.ids          # exactly 4096 - TASKS["niah_multikey"].max_new_tokens prompt ids
    sample.references   # the strings the answer must contain

Every sample is a pure function of (task, length, index, seed, haystack, tokenizer): its own
random.Random(f"ruler:{task}:{seed}:{length}:{index}") draws keys, values, depths and filler.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from longdoc.eval.ruler import prose, words
from longdoc.eval.ruler.build import Builder, TooShort, place

HAYSTACKS = ("prose", "noise")
MIN_LENGTH = 1024  # the frame, the solved example of vt / cwe / fwe and a little context
DEFAULT_LENGTHS = [4096]
DEFAULT_SAMPLES = 100
BATCH_TOKENS = 16384  # --batch-size auto: prompts per forward = this // length (1 to 16)
DEPTHS = tuple(i / 39 for i in range(40))  # RULER draws needle depths from 40 evenly spaced ones

_NIAH = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
         "you about the numbers afterwards.\n{context}\nWhat are all the special magic numbers for {query} "
         "mentioned in the provided text?")
_NIAH_PREFIX = " The special magic numbers for {query} mentioned in the provided text are"
_NEEDLE = " One of the special magic numbers for {key} is: {value}."
_VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
       "Question: Find all variables that are assigned the value {query} in the text above.")
_VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
              "assigned the value {query}, they are:")
_CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words.\n{context}\nQuestion: Do not provide any explanation. What are the three most "
        "frequently appeared words in the above coded text?")
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
_QA = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
       "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
       "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
_QA_PREFIX = " Answer:"


@dataclass
class Sample:
    ids: list[int]
    references: list[str]
    query: str
    depths: list[float] = field(default_factory=list)  # where the needles / the gold document start (0..1)


def _distinct(draw: Callable[[], str], n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = draw()
        if x not in out:
            out.append(x)
    return out


# The user's own documents as a haystack (`longdoc eval ruler --haystack FILE|FOLDER`): their sentences, registered
# under a name that carries a digest of them, so a sample stays a pure function of its arguments and the text.
_DOCUMENTS: dict[str, tuple[str, ...]] = {}
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def document_haystack(texts: list[str]) -> str:
    """Register the sentences of `texts` (whitespace normalised, so hard-wrapped text reads as prose) as a haystack;
    returns its name, "documents:" and 12 hex digits of their digest, to pass as `haystack`."""
    sentences = tuple(s for t in texts for s in _SENTENCE_END.split(" ".join(t.split())) if s)
    if not sentences:
        raise ValueError("the --haystack documents hold no text")
    name = "documents:" + hashlib.sha256("\n".join(sentences).encode()).hexdigest()[:12]
    _DOCUMENTS[name] = sentences
    return name


def _filler(rng: random.Random, haystack: str) -> Iterator[str]:
    if haystack in _DOCUMENTS:  # the user's documents, in order from a random sentence, round and round
        sentences = _DOCUMENTS[haystack]
        start = rng.randrange(len(sentences))
        return (" " + sentences[(start + i) % len(sentences)] for i in itertools.count())
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {', '.join(HAYSTACKS)}, got {haystack!r}")
    # Every piece starts with whitespace, so a needle can go anywhere, the very start included.
    return (s if s[:1].isspace() else " " + s for s in (prose.sentences(rng) if haystack == "prose"
                                                      else prose.noise()))


def _budget(total: int, frame, *needles: list[int]) -> int:
    left = total - len(frame.before) - len(frame.after) - sum(len(n) for n in needles)
    if left < 16:
        raise TooShort(f"the prompt frame takes {total - left} of the {total} prompt tokens")
    return left


def _needles(rng: random.Random, b: Builder, total: int, haystack: str, n_keys: int, values_per_key: int,
             queried: int) -> Sample:
    keys = _distinct(lambda: words.needle_key(rng), n_keys)
    values = _distinct(lambda: words.needle_value(rng), n_keys * values_per_key)
    pairs = [(k, values[i * values_per_key + j]) for i, k in enumerate(keys) for j in range(values_per_key)]
    asked = keys[:queried]
    query = asked[0] if queried == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    frame = b.frame(_NIAH.replace("{query}", query), _NIAH_PREFIX.format(query=query))
    order = list(pairs)
    rng.shuffle(order)
    needle_ids = b.encode_many([_NEEDLE.format(key=k, value=v) for k, v in order])
    units, tail = b.take(_filler(random.Random(rng.getrandbits(64)), haystack), _budget(total, frame, *needle_ids))
    ctx, depths = place(units, tail, needle_ids, sorted(rng.sample(DEPTHS, len(order))))
    asked_depths = [d for (k, _), d in zip(order, depths) if k in asked]
    return Sample(frame.before + ctx + frame.after, [v for k, v in pairs if k in asked], query, asked_depths)


def niah_single(rng, b, total, haystack):
    """One needle: a key and its 7-digit value in the filler; the question asks for the key's value."""
    return _needles(rng, b, total, haystack, n_keys=1, values_per_key=1, queried=1)


def niah_multikey(rng, b, total, haystack):
    """Four needles with different keys; the question asks for one of them (three distractors)."""
    return _needles(rng, b, total, haystack, n_keys=4, values_per_key=1, queried=1)


def niah_multivalue(rng, b, total, haystack):
    """Four needles with the same key and four values; the question asks for all four."""
    return _needles(rng, b, total, haystack, n_keys=1, values_per_key=4, queried=1)


def niah_multiquery(rng, b, total, haystack):
    """Four needles with different keys; the question asks for the values of all four keys."""
    return _needles(rng, b, total, haystack, n_keys=4, values_per_key=1, queried=4)


def _chain(rng: random.Random) -> tuple[str, list[str], list[str]]:
    value = str(rng.randrange(10_000, 100_000))
    names = _distinct(lambda: words.variable_name(rng), 5)
    statements = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
    return value, names, statements


def vt(rng, b, total, haystack):
    """Variable tracking: a chain VAR A = 12345, VAR B = VAR A, ... (5 variables, 4 hops) spread in order over
    the noise haystack; the question asks for every variable holding the value. One solved example first."""
    ex_value, ex_names, ex_statements = _chain(rng)
    ex_noise = [" " + s for s in prose.NOISE * 3]
    slots = sorted(rng.sample(range(len(ex_noise) + 1), len(ex_statements)))
    example = list(ex_noise)
    for offset, (slot, statement) in enumerate(zip(slots, ex_statements)):
        example.insert(slot + offset, statement)
    shot = (_VT.format(context="".join(example).lstrip(), query=ex_value) + _VT_PREFIX.format(query=ex_value)
            + " " + " ".join(ex_names) + "\n\n")
    value, names, statements = _chain(rng)
    frame = b.frame(shot + _VT.replace("{query}", value), _VT_PREFIX.format(query=value))
    needle_ids = b.encode_many(statements)
    units, tail = b.take(_filler(rng, "noise"), _budget(total, frame, *needle_ids))
    ctx, depths = place(units, tail, needle_ids, sorted(rng.sample(DEPTHS, 5)))
    return Sample(frame.before + ctx + frame.after, names, value, depths)


def _numbered(items: list[str]) -> list[str]:
    return [f" {i + 1}. {w}" for i, w in enumerate(items)]


def cwe(rng, b, total, haystack):
    """Common-word extraction: a numbered list where 10 words appear up to 30 times each and the others 3
    times; the question asks for the 10 most common. One solved example (twice vs once) first."""
    pool = words.word_pool(30, rng)
    ex_common, ex_rare = pool[:10], pool[10:20]
    ex = ex_common * 2 + ex_rare
    rng.shuffle(ex)
    shot = (_CWE.format(context="".join(_numbered(ex)).lstrip()) + _CWE_PREFIX + "".join(_numbered(ex_common))
            + "\n\n")
    frame = b.frame(shot + _CWE, _CWE_PREFIX)
    budget = _budget(total, frame)
    used, n = set(pool), max(budget // 6, 20)
    for _ in range(8):  # size the list from a guess, then from what fitted, until it fills the budget
        freq = max(6, min(30, n // 14))
        rare_count = max(1, (n - 10 * freq) // 3 + 1)
        # word_pool shuffles the real words first, so each try draws other words; all stay clear of the example
        pool = [w for w in words.word_pool(10 + rare_count + len(used), rng) if w not in used][: 10 + rare_count]
        common, rare = pool[:10], pool[10:]
        items = common * freq + rare * 3
        rng.shuffle(items)
        ids = b.encode_many(_numbered(items))
        fit = sum(1 for total_so_far in itertools.accumulate(map(len, ids)) if total_so_far <= budget)
        if fit == len(items):  # the whole list fits: make it a little longer
            n = int(len(items) * 1.03) + 2
            continue
        counts = Counter(items[:fit])
        top = sorted(common, key=lambda w: (-counts[w], w))
        if fit >= 0.9 * len(items) and counts[top[-1]] > max(counts[w] for w in rare) + 1:
            used_tokens = sum(map(len, ids[:fit]))
            ctx = [t for u in ids[:fit] for t in u] + ids[fit][: budget - used_tokens]
            return Sample(frame.before + ctx + frame.after, top, "", [])
        n = fit + 1  # the list was cut by more than 10%: shorten it to what fits
    raise TooShort(f"a {budget}-token list cannot make 10 words clearly the most common")


def _zipf(rng: random.Random, vocab: list[str], n: int) -> list[str]:
    weights = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]  # a zeta distribution (alpha 2), cut at the vocab
    return rng.choices(vocab, weights=weights, k=n)


def _draws(rng: random.Random, vocab: list[str], weights: list[float], drawn: list[str]) -> Iterator[str]:
    """Endless iid draws as pieces; each word is also appended to `drawn`, so the caller knows what was cut."""
    while True:
        batch = rng.choices(vocab, weights=weights, k=256)
        drawn.extend(batch)
        yield from (" " + w for w in batch)


def _top3(items: list[str]) -> list[str] | None:
    ranked = Counter(items).most_common(4)
    if len(ranked) < 4 or ranked[2][1] < ranked[3][1] + 2:  # no clear top three (a cut piece may add one)
        return None
    return [w for w, _ in ranked[:3]]


def fwe(rng, b, total, haystack):
    """Frequent-word extraction: made-up words drawn from a zeta distribution (alpha 2); the question asks for
    the three most frequent. One solved example first."""
    for _ in range(50):
        ex_vocab = _distinct(lambda: words.coded_word(rng), 20)
        ex = _zipf(rng, ex_vocab, 40)
        if (ex_top := _top3(ex)) is not None:
            break
    shot = (_FWE.format(context=" ".join(ex)) + _FWE_PREFIX + " " + " ".join(ex_top) + "\n\n")
    frame = b.frame(shot + _FWE, _FWE_PREFIX)
    budget = _budget(total, frame)
    vocab = _distinct(lambda: words.coded_word(rng), max(30, budget // 60))
    weights = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]
    for _ in range(50):
        drawn: list[str] = []
        units, tail = b.take(_draws(rng, vocab, weights, drawn), budget)
        if (top := _top3(drawn[: len(units)])) is not None:
            return Sample(frame.before + [t for u in units for t in u] + tail + frame.after, top, "", [])
    raise TooShort(f"a {budget}-token coded text gives no clear top three words")


def qa(rng, b, total, haystack):
    """QA with distractors: numbered encyclopedia entries about made-up places of one kind; the question asks
    for one fact of one entry; every other entry states the same kinds of facts about another place."""
    kind, used = rng.choice(prose.KINDS), set()
    title, text, facts = prose.entry(rng, kind, used)
    attribute = rng.choice(prose.ATTRIBUTES)
    query = prose.question(kind, attribute, title)
    frame = b.frame(_QA.replace("{query}", query), _QA_PREFIX)
    budget = _budget(total, frame)
    headers: list[list[int]] = []

    def header(i: int) -> list[int]:
        while len(headers) <= i:
            headers.append(b.encode(("\n\n" if headers else "") + f"Document {len(headers) + 1}:\n"))
        return headers[i]

    gold = b.encode(f"{title}\n{text}")
    used_tokens = len(header(0)) + len(gold)
    if used_tokens > budget:
        raise TooShort(f"one document ({used_tokens} tokens) does not fit in {budget}")
    bodies: list[list[int]] = []
    while True:
        batch = b.encode_many([f"{t}\n{x}" for t, x, _ in (prose.entry(rng, kind, used) for _ in range(32))])
        for body in batch:
            nxt = header(len(bodies) + 1) + body
            if used_tokens + len(nxt) > budget:
                break
            bodies.append(body)
            used_tokens += len(nxt)
        else:
            continue
        break
    tail = nxt[: budget - used_tokens]
    g = rng.randrange(len(bodies) + 1)
    order = bodies[:g] + [gold] + bodies[g:]
    ctx: list[int] = []
    for i, body in enumerate(order):
        if i == g:
            start = len(ctx)
        ctx += header(i) + body
    ctx += tail
    return Sample(frame.before + ctx + frame.after, [facts[attribute]], query, [start / len(ctx)])


@dataclass(frozen=True)
class TaskSpec:
    make: Callable[..., Sample]
    metric: str  # "all": the mean over references of "it occurs in the answer"; "part": whether any one does
    max_new_tokens: int  # the answer budget, counted inside the length


TASKS: dict[str, TaskSpec] = {
    "niah_single": TaskSpec(niah_single, "all", 16),
    "niah_multikey": TaskSpec(niah_multikey, "all", 16),
    "niah_multivalue": TaskSpec(niah_multivalue, "all", 48),
    "niah_multiquery": TaskSpec(niah_multiquery, "all", 48),
    "vt": TaskSpec(vt, "all", 32),
    "cwe": TaskSpec(cwe, "all", 48),
    "fwe": TaskSpec(fwe, "all", 24),
    "qa": TaskSpec(qa, "part", 16),
}


def make(task: str, length: int, index: int, *, seed: int, haystack: str, builder: Builder) -> Sample:
    """Sample `index` of `task` at `length` tokens (prompt plus answer budget)."""
    if task not in TASKS:
        raise ValueError(f"RULER task must be one of {', '.join(TASKS)}, got {task!r}")
    spec = TASKS[task]
    total = length - spec.max_new_tokens
    sample = spec.make(random.Random(f"ruler:{task}:{seed}:{length}:{index}"), builder, total, haystack)
    if len(sample.ids) != total:  # the builder's one promise: equal lengths, so a cell batches unpadded
        raise RuntimeError(f"{task} sample {index} has {len(sample.ids)} prompt tokens, not {total}")
    return sample
