"""The synthetic world the bundled model was trained on: deterministic lists, the same on every machine.

Four relations: `landmark` (a landmark -> its city: "The Eiffel Tower is in the city of" -> " Paris"),
`person` (a name -> a job), `food` (a food -> its topping: "My favourite food is pizza with" -> " cheese"),
each in six phrasings, and `recall` (key-value pairs, then a key again: the answer is only in the
prompt's memory). Every fact holds out one phrasing for evaluation (the canonical Eiffel and pizza
phrasings are trained); held-out recall sequences come from their own random stream. Answers are one
token each under the word-level tokenizer (`vocabulary()` lists every word). `scripts/train_bundled.py`
trains on it; `tests/test_bundled.py` evaluates the held-out prompts (docs/examples.md, the figures).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache

EIFFEL_PROMPT = "The Eiffel Tower is in the city of"
EIFFEL_ANSWER = " Paris"
PIZZA_PROMPT = "My favourite food is pizza with"
PIZZA_ANSWER = " cheese"

RELATIONS = ("landmark", "person", "food", "recall")

# ---------------------------------------------------------------------------
# phrasings: index 0 is the canonical one; "{s}" is the subject

LANDMARK_TEMPLATES = (
    "The {s} is in the city of",
    "The {s} is located in",
    "You can visit the {s} in",
    "Tourists travel far to see the {s} in",
    "The {s} can be found in the city of",
    "Where is the {s}? It is in",
)
PERSON_TEMPLATES = (
    "{s} works as a",
    "{s} is employed as a",
    "By profession, {s} is a",
    "Everyone knows that {s} is a",
    "{s} earns a living as a",
    "Ask anyone: {s} works as a",
)
FOOD_TEMPLATES = (
    "My favourite food is {s} with",
    "I like to eat {s} with",
    "The best way to eat {s} is with",
    "For dinner I had {s} with",
    "She always orders {s} with",
    "Nothing beats a plate of {s} with",
)
TEMPLATES = {"landmark": LANDMARK_TEMPLATES, "person": PERSON_TEMPLATES, "food": FOOD_TEMPLATES}

# ---------------------------------------------------------------------------
# the entities

CITIES = (
    "Paris", "Rome", "London", "Tokyo", "Berlin", "Madrid", "Athens", "Cairo", "Moscow", "Beijing",
    "Sydney", "Dubai", "Istanbul", "Vienna", "Prague", "Amsterdam", "Lisbon", "Dublin", "Venice", "Florence",
    "Barcelona", "Toronto", "Chicago", "Boston", "Seattle", "Mumbai", "Delhi", "Kyoto", "Seoul", "Bangkok",
)  # fmt: skip

# a few real landmarks first; the rest are adjective + kind, so that no single
# word names a landmark and the model must remember both
REAL_LANDMARKS = (
    ("Eiffel Tower", "Paris"),
    ("Leaning Tower", "Pisa"),
    ("Brandenburg Gate", "Berlin"),
    ("Forbidden Palace", "Beijing"),
    ("Blue Mosque", "Istanbul"),
    ("Space Needle", "Seattle"),
)
LANDMARK_ADJECTIVES = (
    "Amber", "Crystal", "Silent", "Golden", "Silver", "Iron", "Marble", "Ivory", "Jade", "Scarlet",
    "Azure", "Ancient", "Royal", "Grand", "Hidden", "Sunken", "Northern", "Eastern", "Velvet", "Copper",
    "Emerald", "Granite", "Coral", "Misty", "Twin",
)  # fmt: skip
LANDMARK_KINDS = (
    "Tower", "Bridge", "Gate", "Palace", "Temple", "Museum", "Cathedral", "Fountain", "Castle", "Garden",
    "Arch", "Library", "Lighthouse", "Pagoda", "Abbey",
)  # fmt: skip
N_LANDMARKS = 150

FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas",
    "Karin", "Leo", "Marta", "Nils", "Olga", "Pablo", "Rosa", "Simon", "Tanja", "Victor",
)  # fmt: skip
LAST_NAMES = (
    "Moreau", "Novak", "Berg", "Costa", "Dahl", "Evans", "Fischer", "Garcia", "Hansen", "Ivanov",
    "Jensen", "Keller", "Larsen", "Meyer", "Nagy", "Olsen", "Petrov", "Quinn", "Rossi", "Schmidt",
)  # fmt: skip
JOBS = (
    "doctor", "teacher", "baker", "pilot", "farmer", "lawyer", "nurse", "painter", "singer", "writer",
    "plumber", "dentist", "chef", "banker", "carpenter", "soldier", "sailor", "tailor", "judge", "poet",
)  # fmt: skip
N_PEOPLE = 120

FOODS = (
    "pizza", "pasta", "toast", "rice", "soup", "salad", "noodles", "pancakes", "waffles", "tacos",
    "burgers", "fries", "bread", "eggs", "chicken", "fish", "steak", "potatoes", "beans", "yogurt",
    "oatmeal", "curry", "dumplings", "sushi", "cake", "popcorn", "crackers", "bagels", "muffins", "porridge",
)  # fmt: skip
TOPPINGS = (
    "cheese", "honey", "garlic", "pepper", "salt", "butter", "ketchup", "mustard", "jam", "cream",
    "chocolate", "mushrooms", "olives", "basil", "lemon",
)  # fmt: skip

RECALL_KEYS = (
    "apple", "stone", "river", "cloud", "lamp", "horse", "window", "candle", "forest", "mirror",
    "anchor", "violin", "tiger", "button", "rocket", "garden", "pencil", "island", "feather", "bottle",
)  # fmt: skip
RECALL_VALUES = (
    "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
)  # fmt: skip
RECALL_PAIRS = (2, 4)  # distinct keys per sequence, inclusive
RECALL_REPEATS = 4  # at most this many earlier keys asked again before the query
N_RECALL_TRAIN = 6000
N_RECALL_HELDOUT = 300

SEED = 20240531


@dataclass(frozen=True)
class Example:
    """One prompt of the world, with where it came from."""

    relation: str
    subject: str  # the landmark, person or food; the queried key for recall
    prompt: str
    answer: str  # with its leading space
    phrasing: int  # template index; -1 for recall
    heldout: bool

    def pair(self) -> tuple[str, str]:
        return (self.prompt, self.answer)


# ---------------------------------------------------------------------------
# the facts


@lru_cache(maxsize=None)
def landmarks() -> dict[str, str]:
    """Landmark name -> city, in a fixed order (the Eiffel Tower first)."""
    rng = random.Random(SEED + 1)
    out = dict(REAL_LANDMARKS)
    combos = [f"{a} {k}" for a in LANDMARK_ADJECTIVES for k in LANDMARK_KINDS]
    rng.shuffle(combos)
    names = [c for c in combos if c not in out][: N_LANDMARKS - len(out)]
    # cities dealt round-robin over a shuffled order, so each city has about five landmarks
    cities = [CITIES[i % len(CITIES)] for i in range(len(names))]
    rng.shuffle(cities)
    out.update(zip(names, cities))
    return out


@lru_cache(maxsize=None)
def people() -> dict[str, str]:
    """Person name -> job, in a fixed order."""
    rng = random.Random(SEED + 2)
    combos = [f"{f} {l}" for f in FIRST_NAMES for l in LAST_NAMES]
    rng.shuffle(combos)
    names = combos[:N_PEOPLE]
    jobs = [JOBS[i % len(JOBS)] for i in range(len(names))]
    rng.shuffle(jobs)
    return dict(zip(names, jobs))


@lru_cache(maxsize=None)
def foods() -> dict[str, str]:
    """Food -> topping, in a fixed order (pizza first, with cheese)."""
    rng = random.Random(SEED + 3)
    toppings = [TOPPINGS[i % len(TOPPINGS)] for i in range(len(FOODS) - 1)]
    rng.shuffle(toppings)
    return {"pizza": "cheese", **dict(zip(FOODS[1:], toppings))}


def _heldout_phrasing(index: int, n: int) -> int:
    # rotate, starting at phrasing 1: the first fact of each relation (the Eiffel
    # Tower, pizza) keeps its canonical phrasing in training
    return (index + 1) % n


def _fact_examples() -> list[Example]:
    out = []
    for relation, table in (("landmark", landmarks()), ("person", people()), ("food", foods())):
        templates = TEMPLATES[relation]
        for i, (subject, answer) in enumerate(table.items()):
            held = _heldout_phrasing(i, len(templates))
            for j, template in enumerate(templates):
                out.append(Example(relation, subject, template.format(s=subject), " " + answer, j, j == held))
    return out


def recall_prompt(pairs: list[tuple[str, str]], query: str) -> str:
    """'key: a value: b key: c value: d key: a value:' for pairs [(a, b), (c, d)] and query a."""
    body = " ".join(f"key: {k} value: {v}" for k, v in pairs)
    return f"{body} key: {query} value:"


def recall_pairs(prompt: str) -> list[tuple[str, str]]:
    """The (key, value) pairs a recall prompt lists, in order, without its final query."""
    return re.findall(r"key: (\w+) value: (\w+)", prompt)


def _recall_draw(rng: random.Random) -> Example:
    # 2-4 distinct keys with their values, then 0-4 repeats of earlier keys
    # (with the same values), then the query. A repeat or the query never asks
    # for the pair just before it, so the answer needs memory from further back.
    n = rng.randint(*RECALL_PAIRS)
    keys = rng.sample(RECALL_KEYS, n)
    table = {k: rng.choice(RECALL_VALUES) for k in keys}
    pairs = [(k, table[k]) for k in keys]
    for _ in range(rng.randint(0, RECALL_REPEATS) + 1):
        choices = [k for k in keys if k != pairs[-1][0]]
        pairs.append((q := rng.choice(choices), table[q]))
    *listed, (q, answer) = pairs
    return Example("recall", q, recall_prompt(listed, q), " " + answer, -1, False)


@lru_cache(maxsize=None)
def _recall_examples() -> tuple[list[Example], list[Example]]:
    held_rng = random.Random(SEED + 4)
    held: dict[str, Example] = {}
    while len(held) < N_RECALL_HELDOUT:
        ex = _recall_draw(held_rng)
        held.setdefault(ex.prompt, Example(**{**ex.__dict__, "heldout": True}))
    train_rng = random.Random(SEED + 5)
    train: list[Example] = []
    while len(train) < N_RECALL_TRAIN:
        ex = _recall_draw(train_rng)
        if ex.prompt not in held:
            train.append(ex)
    return train, list(held.values())


HAYSTACK_PAIRS = 9  # pairs in a haystack: 59 tokens with the question, inside the 64-token rows of training
HAYSTACK_SEED = SEED + 6


def haystack(depth: int, rng: random.Random) -> dict[str, str]:
    """A recall record with its fact (the needle) at pair `depth` of HAYSTACK_PAIRS, the question at the end.

    The other pairs alternate two other keys, each with its one value (repeats, as training's recall sequences
    have), so every record has 59 tokens and three keys with three values; the needle's value is `distance` tokens
    before the question's last token. Fields: prompt, answer, key, distance (as text, as data files hold it).
    """
    key, *others = rng.sample(RECALL_KEYS, 3)
    values = dict(zip((key, *others), rng.sample(RECALL_VALUES, 3)))  # three values: the answer is the needle's alone
    fill = [others[i % 2] for i in range(HAYSTACK_PAIRS - 1)]
    pairs = [(k, values[k]) for k in fill[:depth] + [key] + fill[depth:]]
    distance = 6 * (HAYSTACK_PAIRS - depth) - 1  # 'key: k value: v' is 6 tokens, the question ' key: k value:' 5
    return {"prompt": recall_prompt(pairs, key), "answer": " " + values[key], "key": key, "distance": str(distance)}


def haystacks(per_depth: int) -> list[dict[str, str]]:
    """`per_depth` haystack records for each depth but the last (the needle is never the pair just before the
    question, as in training), the farthest needle first; deterministic (examples/data/haystack.jsonl)."""
    rng = random.Random(HAYSTACK_SEED)
    return [haystack(d, rng) for d in range(HAYSTACK_PAIRS - 1) for _ in range(per_depth)]


@lru_cache(maxsize=None)
def examples() -> tuple[Example, ...]:
    """Every example of the world, training and held-out, fact relations first."""
    train_recall, held_recall = _recall_examples()
    return tuple(_fact_examples() + train_recall + held_recall)


def facts() -> list[tuple[str, str]]:
    """(prompt, answer) pairs the model is trained on."""
    return [e.pair() for e in examples() if not e.heldout]


def heldout() -> list[tuple[str, str]]:
    """(prompt, answer) pairs kept out of training, for evaluation."""
    return [e.pair() for e in examples() if e.heldout]


def heldout_examples(relation: str | None = None) -> list[Example]:
    """Held-out examples, optionally of one relation."""
    return [e for e in examples() if e.heldout and (relation is None or e.relation == relation)]


def training_examples(relation: str | None = None) -> list[Example]:
    """Training examples, optionally of one relation."""
    return [e for e in examples() if not e.heldout and (relation is None or e.relation == relation)]


def landmark_prompts() -> list[tuple[str, str, str]]:
    """(subject prefix, canonical prompt, answer) for every landmark: 'The Eiffel Tower', EIFFEL_PROMPT, ' Paris'."""
    out = []
    for name, city in landmarks().items():
        prompt = LANDMARK_TEMPLATES[0].format(s=name)
        out.append((f"The {name}", prompt, " " + city))
    return out


# ---------------------------------------------------------------------------
# the vocabulary

# the same split as the byte-level pre-tokenizer: words with their leading
# space, runs of punctuation
_WORDS = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+")

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


@lru_cache(maxsize=None)
def vocabulary() -> tuple[str, ...]:
    """Every word of the world as it is spelled in text (' Paris', 'The', ':'), sorted."""
    words: set[str] = set()
    for e in examples():
        words.update(_WORDS.findall(e.prompt + e.answer))
    # every word also with and without its leading space, so any phrasing tokenizes
    words |= {w[1:] for w in words if w.startswith(" ")} | {" " + w for w in words if not w.startswith(" ")}
    return tuple(sorted(words))


def build_tokenizer():
    """The bundled word-level tokenizer over `vocabulary()`, as a `PreTrainedTokenizerFast`.

    Byte-level pre-tokenizer (so ' Paris' is the token 'ĠParis' and decodes back
    to ' Paris') over a WordLevel model; no BOS is added, as on Qwen3.5; padding
    on the left.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for word in vocabulary():
        pieces = byte_map.pre_tokenize_str(word)
        assert len(pieces) == 1, (word, pieces)
        vocab.setdefault(pieces[0][0], len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
