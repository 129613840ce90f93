"""Filler prose and short reference documents for the RULER-style suite, from a template family of its own.

RULER's haystacks are Paul Graham's essays, or a repeated line of noise; neither can ship here, and the
training generator's case files and patient charts must not be the haystack (a fine-tuned model would have
seen their templates). So the prose is a traveller's field notes on landscapes, weather, crafts and animals,
one sentence template after another, and the QA documents are short encyclopedia entries about made-up
places and institutions. Both are deterministic in their random.Random.

    sentences(rng)                  endless sentences, paragraph breaks included ("\\n\\n" prefix)
    NOISE                           RULER's repeated noise haystack, sentence by sentence
    entry(rng, kind)                one encyclopedia entry: (title, text, {attribute: value})
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from longdoc.eval.ruler import words

# RULER's noise haystack (niah_single_1, variable tracking): these five sentences over and over.
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

_SEASONS = ("spring", "summer", "autumn", "winter", "the wet season", "the dry months")
_TIMES = ("at dawn", "by midday", "in the late afternoon", "at dusk", "after dark", "before the first frost")
_WEATHER = ("a thin rain", "a steady wind from the west", "low cloud", "a warm haze", "sleet", "a clear sky")
_CRAFTS = ("basket weaving", "boat building", "glass blowing", "rope making", "cheese making", "wood carving",
           "bell casting", "paper folding")
_ANIMALS = ("herons", "foxes", "otters", "goats", "swallows", "hares", "crows", "deer", "bees", "owls")

_TEMPLATES = (
    "In {season} the {adj} {noun} near {town} fills with {animal} that come down from the hills.",
    "The road to {town} follows the {noun} for {n} miles before it climbs into {adj} country.",
    "Nobody in {town} remembers when the old {noun} was built, only that it has always been {adj}.",
    "{time_cap} the {animal} gather by the {noun}, and the whole valley goes quiet.",
    "A {adj} light falls across the {noun} {time}, and the fishermen say it means {weather}.",
    "The people of {town} are known for {craft}, which they learned from traders who crossed the {noun2}.",
    "We walked along the {adj} {noun} until the path turned to {adj2} sand.",
    "There were {n} {nouns} stacked against the wall of the inn, each one marked with a {adj} ribbon.",
    "The innkeeper told us that {weather} had kept the boats in the harbor for {n} days.",
    "From the top of the {noun} you can see {town}, the {noun2} and, on a good day, the sea.",
    "Every {season} the village holds a fair where the best {craft} is judged by the oldest residents.",
    "The {animal} here are bolder than anywhere else, and they will take bread from an open hand.",
    "It is said that a {adj} {noun} once stood where the market is now, but no trace of it remains.",
    "By evening {weather} had settled over the {noun}, and we lit a fire in the {adj} hearth.",
    "Most of the houses in {town} are built of {adj} stone, quarried from the {noun} to the north.",
    "The children of the town learn {craft} before they learn to write, or so the saying goes.",
    "A narrow bridge crosses the {noun} below {town}, and it sways whenever the {animal} cross it.",
    "We counted {n} {nouns} on the slope above the {noun2} before the light gave out.",
    "The market sells {nouns}, honey and {adj} cloth, and in {season} it stays open until late.",
    "Travellers who reach {town} {time} are offered soup and a seat by the {noun}.",
    "The river is {adj} here, and the ferry takes {n} passengers at a time to the far bank.",
    "An old map in the library shows the {noun} twice as large as it is today.",
    "Walking on, we passed a {adj} {noun} where someone had left a row of {nouns} to dry.",
    "The wind in {season} is strong enough to turn the sails of every mill along the {noun}.",
    "Nothing grows on the {adj} side of the hill except thistles and a few stubborn {nouns}.",
    "In the square at {town} a stone {noun} marks the spot where the first settlers camped.",
    "The locals claim the {animal} can predict {weather} a full day before it arrives.",
    "We rested by a {adj} {noun}, listening to the {animal} and the distant bells of {town}.",
    "The path is steep for the last {n} minutes, but the view of the {noun} repays the climb.",
    "Boats painted in {adj} colors line the shore, each named after a saint or a {noun}.",
    "The cooks of {town} use more {noun2} than salt, and their bread tastes of it.",
    "Once a year the whole valley walks to the {adj} {noun} and back, singing the whole way.",
    "Snow seldom reaches the {noun}, yet the old people keep sledges in their barns.",
    "We met a shepherd who had not left the {adj} pastures above {town} for {n} years.",
    "Every door in the lane has a {noun} carved above it, for luck or for the weather.",
    "The tide comes in quickly over the {adj} flats, and the {animal} leave just before it.",
)


def _plural(noun: str) -> str:
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def sentence(rng: random.Random, towns: list[str]) -> str:
    template = rng.choice(_TEMPLATES)
    time = rng.choice(_TIMES)
    slots = dict(adj=rng.choice(words.ADJECTIVES), adj2=rng.choice(words.ADJECTIVES), noun=rng.choice(words.NOUNS),
                 noun2=rng.choice(words.NOUNS), nouns=_plural(rng.choice(words.NOUNS)), town=rng.choice(towns),
                 season=rng.choice(_SEASONS), time=time, time_cap=time[0].upper() + time[1:],
                 weather=rng.choice(_WEATHER), craft=rng.choice(_CRAFTS), animal=rng.choice(_ANIMALS),
                 n=rng.randrange(2, 60))
    text = template.format(**slots)
    return text[0].upper() + text[1:]


def sentences(rng: random.Random) -> Iterator[str]:
    """Endless field-note sentences; each but the first starts with " " (same paragraph) or "\\n\\n"."""
    towns = [words.made_up_name(rng, 2) for _ in range(12)]
    first = True
    while True:
        for i in range(rng.randrange(4, 9)):  # one paragraph
            text = sentence(rng, towns)
            yield text if first else ("\n\n" if i == 0 else " ") + text
            first = False


def noise() -> Iterator[str]:
    """RULER's noise haystack, sentence by sentence, forever."""
    first = True
    while True:
        for s in NOISE:
            yield s if first else " " + s
            first = False


# Encyclopedia entries for the QA task: a kind of place, the facts an entry states, and how each is asked.
_KINDS: dict[str, dict[str, tuple[str, str]]] = {
    # attribute: (sentence stating it, question asking for it); {name} is the entry's title
    "lighthouse": {
        "year": ("The {name} was first lit in {year}.", "In what year was the {name} first lit?"),
        "keeper": ("Its first keeper was {person}.", "Who was the first keeper of the {name}?"),
        "town": ("It stands on the headland above {town}.", "Above which town does the {name} stand?"),
        "color": ("The tower is painted {color}.", "What color is the tower of the {name} painted?"),
    },
    "observatory": {
        "year": ("The {name} opened in {year}.", "In what year did the {name} open?"),
        "keeper": ("It was founded by the astronomer {person}.", "Which astronomer founded the {name}?"),
        "town": ("It sits on a ridge outside {town}.", "Outside which town does the {name} sit?"),
        "color": ("Its dome is {color}.", "What color is the dome of the {name}?"),
    },
    "abbey": {
        "year": ("The {name} was consecrated in {year}.", "In what year was the {name} consecrated?"),
        "keeper": ("Its first abbot was {person}.", "Who was the first abbot of the {name}?"),
        "town": ("It lies in the valley below {town}.", "Below which town does the {name} lie?"),
        "color": ("Its bell tower is built of {color} stone.", "What color is the stone of the {name}'s bell tower?"),
    },
    "glassworks": {
        "year": ("The {name} began work in {year}.", "In what year did the {name} begin work?"),
        "keeper": ("It was started by the glassmaker {person}.", "Which glassmaker started the {name}?"),
        "town": ("Its furnaces stand by the river at {town}.", "At which town do the furnaces of the {name} stand?"),
        "color": ("It is best known for {color} bottles.", "What color of bottles is the {name} best known for?"),
    },
}
KINDS = tuple(_KINDS)
ATTRIBUTES = ("year", "keeper", "town", "color")
_COLORS = ("white", "red", "green", "blue", "black", "yellow", "grey", "orange", "violet", "brown")
_SUFFIX = {"lighthouse": "Lighthouse", "observatory": "Observatory", "abbey": "Abbey", "glassworks": "Glassworks"}


def entry(rng: random.Random, kind: str, used: set[str]) -> tuple[str, str, dict[str, str]]:
    """(title, text, facts) of one encyclopedia entry of `kind` with a title not in `used` (then added)."""
    while True:
        title = f"{words.made_up_name(rng, 2)} {_SUFFIX[kind]}"
        if title not in used:
            used.add(title)
            break
    facts = {"year": str(rng.randrange(1550, 1950)), "color": rng.choice(_COLORS),
             "keeper": f"{words.made_up_name(rng, 2)} {words.made_up_name(rng, 3)}",
             "town": words.made_up_name(rng, 2)}
    slots = dict(name=title, person=facts["keeper"], **facts)
    stated = [_KINDS[kind][a][0].format(**slots) for a in ATTRIBUTES]
    rng.shuffle(stated)
    towns = [facts["town"]]
    filler = [sentence(rng, towns) for _ in range(rng.randrange(1, 3))]
    return title, " ".join(stated[:2] + filler + stated[2:]), facts


def question(kind: str, attribute: str, title: str) -> str:
    return _KINDS[kind][attribute][1].format(name=title)
