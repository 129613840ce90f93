"""Vocabularies of the RULER-style suite: needle keys, the word-list pool, made-up names and coded words.

Everything here belongs to the evaluation only. The training generator (longdoc.corpus.synth, data/synth)
never reads this module, and tests/unit/test_ruler_generate.py checks that no generated text of one shows up
in the other, so the suite measures transfer rather than recall of training templates.
"""

from __future__ import annotations

import random

ADJECTIVES = tuple("""
amber ancient arctic azure bitter brisk bronze calm candid cedar chalky cheerful coastal copper coral crimson
crisp curious dappled dusky eager early faded feathery fern fertile fiery foggy frosty gentle gilded glassy
golden grassy hazel hollow humble icy idle ivory jade jolly keen lanky leafy lively lofty lucky lunar marble
meadow mellow misty mossy muddy narrow nimble noble oaken olive orchid pale pearly pebbly placid plum polar
quiet rapid rosy rugged rustic sandy scarlet shady silent silver sleepy slender smoky snowy solar sooty spare
speckled spry starry steady stony sunny supple swift tawny tidal timid topaz tranquil umber velvet verdant
violet vivid wary wavy windy wintry wiry woolly zesty
""".split())

NOUNS = tuple("""
acorn anchor anvil apron arbor archway attic badger banner barley barrel basket beacon beetle bellows bramble
bridge brook bucket buckle burrow cabin candle canoe canyon carafe carriage cellar chalice chimney cider
clover cobble comet compass cottage cricket crocus dagger delta dinghy dune easel ember falcon fennel ferry
fiddle finch fjord flagon flute forge fountain gable garnet glacier goblet gondola granary grotto harbor
harp hearth heron hickory hilltop inkwell island ivy jetty juniper kettle kiln lagoon lantern larch ledger
lilac locket loom lute mantle maple marsh meadow mill minnow mitten moor mosaic nectar nutmeg oar orchard
otter paddle pantry parsnip pavilion pebble pelican pepper pier pigeon pillar pine plank plover pond quarry
quill quince raft rampart raven reed ribbon ridge rowan saddle saffron satchel sparrow spindle spruce steeple
stream sundial sycamore tamarind tapestry terrace thicket thimble thistle timber torch tower trellis trowel
tulip turnip valley vessel village vineyard walnut wagon weaver wharf willow windmill wren yarrow
""".split())

# Words of the common-word extraction lists (all distinct from each other; pseudo-words extend the pool).
LIST_WORDS = tuple(dict.fromkeys(NOUNS + ADJECTIVES + tuple("""
abbey alder almond apricot aster atlas bagel balcony bamboo bandit banjo basil bassoon bay beach beaver
birch biscuit bison blossom bobcat bonnet bouquet bracelet brass bread brick broom bubble buffalo butter
cactus camel canal canopy captain caramel cargo carpet carrot castle cattle cedar cherry chestnut chisel
cinnamon citadel clarinet cloak coconut coffee collar copper cradle crane crayon crystal cupboard curtain
cypress daisy dancer desert diamond dolphin donkey dragon drum eagle elbow elephant elm envelope fabric
feather festival fig flamingo flask fleece forest fossil fox garden garlic gazelle geyser ginger giraffe
glove gorilla grape gravel guitar hammer hamster hazelnut helmet hermit honey horizon iceberg igloo jacket
jaguar jasmine jelly kayak kernel koala ladder lemon leopard lettuce lighthouse lily lizard lobster magnet
mango marble meteor mirror monkey mountain mushroom napkin needle noodle oasis octopus olive onion orange
ostrich oven owl oyster palace panda panther papaya parrot peach peanut pearl penguin piano pickle pillow
pirate planet plum poppy potato pumpkin puzzle rabbit radish rainbow river rocket rose ruby salmon sandal
scarf scooter seal shell shovel silk skate sled slipper snail spider sponge squirrel statue stove strawberry
sugar sunflower swan sweater tiger toast tomato tractor trumpet tunnel turtle umbrella velvet violin volcano
waffle walrus wardrobe whale whistle wizard wolf yacht zebra
""".split())))

_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pr", "r", "s", "st",
           "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "y")
_CODAS = ("", "", "l", "n", "r", "s", "th", "x", "m", "nd", "rk", "st")


def syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def made_up_name(rng: random.Random, syllables: int = 3) -> str:
    """A pronounceable capitalized name that is no English word ("Travelmoth", "Dairnex")."""
    return "".join(syllable(rng) for _ in range(syllables)).capitalize()


def needle_key(rng: random.Random) -> str:
    """A RULER-style needle key: an adjective-noun pair ("amber-lantern")."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def needle_value(rng: random.Random) -> str:
    """A 7-digit number, as RULER's numeric needle values."""
    return str(rng.randrange(1_000_000, 10_000_000))


def variable_name(rng: random.Random) -> str:
    """Five upper-case letters, as RULER's variable-tracking names."""
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def coded_word(rng: random.Random) -> str:
    """A made-up lower-case word for frequent-word extraction (RULER's "coded text")."""
    return "".join(syllable(rng) for _ in range(2))


def word_pool(size: int, rng: random.Random) -> list[str]:
    """`size` distinct lower-case words: the real list first (shuffled), then pseudo-words past its end."""
    pool = list(LIST_WORDS)
    rng.shuffle(pool)
    seen = set(pool)
    while len(pool) < size:
        w = coded_word(rng)
        if w not in seen:
            seen.add(w)
            pool.append(w)
    return pool[:size]
