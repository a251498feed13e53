"""The packaged `builtin:chat` corpus: real chat plus generated math, code and instruction rows.

Chat comes from the `chatterbot-corpus` package (2,026 real English conversations, BSD). The
other three tasks are generated here from a fixed seed with answers computed by the generator, so
they are correct and the corpus is identical on every machine. Rows are in Open-PerfectBlend form.
"""
from __future__ import annotations

import random
import re
from importlib import resources
from typing import Iterator

import yaml

GENERATOR_SEED = 20261129
SIZES = {"math": 600, "code": 300, "instruction": 600}


def chatterbot_rows() -> Iterator[dict]:
    root = resources.files("chatterbot_corpus") / "data" / "english"
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".yml"):
            continue
        doc = yaml.safe_load(entry.read_text(encoding="utf-8"))
        topic = entry.name[:-4]
        task = "code" if topic == "coding" else "chat"
        for conv in doc.get("conversations") or []:
            turns = [{"from": "human" if i % 2 == 0 else "gpt", "value": str(t).strip()}
                     for i, t in enumerate(conv)]
            yield {"conversations": turns, "source": f"chatterbot/{topic}", "task": task}


_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Lena", "Ken", "Ada"]
_ITEMS = ["apples", "books", "pencils", "marbles", "stickers", "cookies", "cards", "coins"]
_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))


def _math(rng: random.Random) -> list[tuple[str, str]]:
    kind = rng.randrange(7)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == 0:
        return [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.")]
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return [(f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}.")]
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return [(f"What is {a} times {b}?", f"{a} times {b} is {a * b}.")]
    if kind == 3:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return [(q, f"{name} starts with {a} {item} and gets {b} more, "
                    f"so {name} has {a} + {b} = {a + b} {item}.")]
    if kind == 4:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b = max(a, b), min(a, b)
        q = f"{name} had {a} {item} and gave away {b}. How many {item} are left?"
        return [(q, f"{name} had {a} {item} and gave away {b}, so {a} - {b} = {a - b} {item} are left.")]
    if kind == 5:
        parity = "even" if a % 2 == 0 else "odd"
        why = "it is divisible by 2" if parity == "even" else "it is not divisible by 2"
        return [(f"Is {a} even or odd?", f"{a} is {parity}, because {why}."),
                (f"And {b}?", f"{b} is {'even' if b % 2 == 0 else 'odd'}.")]
    n = rng.randint(2, 30)
    return [(f"What is the square of {n}?", f"The square of {n} is {n} times {n}, which is {n * n}.")]


_CODE_TASKS = [
    ("returns the sum of a list of numbers", "total", ["numbers"],
     "    result = 0\n    for x in numbers:\n        result += x\n    return result"),
    ("returns the largest number in a list", "largest", ["numbers"],
     "    best = numbers[0]\n    for x in numbers[1:]:\n        if x > best:\n            best = x\n    return best"),
    ("reverses a string", "reverse", ["text"], "    return text[::-1]"),
    ("checks whether a string is a palindrome", "is_palindrome", ["text"],
     "    cleaned = text.lower()\n    return cleaned == cleaned[::-1]"),
    ("computes the factorial of n", "factorial", ["n"],
     "    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result"),
    ("returns the n-th Fibonacci number", "fibonacci", ["n"],
     "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("counts the vowels in a string", "count_vowels", ["text"],
     "    return sum(1 for ch in text.lower() if ch in \"aeiou\")"),
    ("keeps only the even numbers of a list", "evens", ["numbers"],
     "    return [x for x in numbers if x % 2 == 0]"),
    ("returns the average of a list of numbers", "average", ["numbers"],
     "    return sum(numbers) / len(numbers)"),
    ("adds two numbers", "add", ["a", "b"], "    return a + b"),
    ("multiplies two numbers", "multiply", ["a", "b"], "    return a * b"),
    ("counts the words in a sentence", "count_words", ["sentence"],
     "    return len(sentence.split())"),
]
_JS = {
    "reverse": "  return text.split(\"\").reverse().join(\"\");",
    "add": "  return a + b;",
    "multiply": "  return a * b;",
    "count_words": "  return sentence.split(/\\s+/).filter(Boolean).length;",
    "evens": "  return numbers.filter((x) => x % 2 === 0);",
    "total": "  return numbers.reduce((acc, x) => acc + x, 0);",
}


_ARG_NAMES = {"numbers": ["numbers", "values", "nums", "items"], "text": ["text", "s", "word", "string"],
              "n": ["n", "k", "count"], "sentence": ["sentence", "line", "text"]}


def _code(rng: random.Random) -> list[tuple[str, str]]:
    what, name, args, body = rng.choice(_CODE_TASKS)
    js = _JS.get(name)
    for arg in args:
        if arg in _ARG_NAMES:
            new = rng.choice(_ARG_NAMES[arg])
            body = re.sub(rf"\b{arg}\b", new, body)
            js = js and re.sub(rf"\b{arg}\b", new, js)
            args = [new if a == arg else a for a in args]
    if js and rng.random() < 0.3:
        q = f"Write a JavaScript function that {what}."
        code = f"function {name}({', '.join(args)}) {{\n{js}\n}}"
        return [(q, f"Here is a JavaScript function that {what}:\n\n```javascript\n{code}\n```")]
    q = rng.choice([f"Write a Python function that {what}.",
                    f"Can you write a Python function called {name} that {what}?",
                    f"How do I write a function in Python that {what}?",
                    f"Show me Python code for a function that {what}."])
    code = f"def {name}({', '.join(args)}):\n{body}"
    answer = f"Here is a Python function that {what}:\n\n```python\n{code}\n```"
    turns = [(q, answer)]
    if rng.random() < 0.25:
        turns.append(("Can you explain how it works?",
                      f"The function {name} takes {', '.join(args)} as input and {what.split(' ', 1)[0]} "
                      f"{what.split(' ', 1)[1]}. It uses only built-in Python features."))
    return turns


_WORDS = ["apple", "river", "garden", "planet", "silver", "window", "guitar", "forest", "camera",
          "pencil", "rocket", "butter", "candle", "dragon", "island", "jacket", "kitten", "lemon",
          "market", "orange", "pirate", "rabbit", "summer", "tunnel", "violin", "winter", "yellow"]
_CATEGORIES = {
    "fruits": ["apple", "banana", "orange", "mango", "grape", "pear", "cherry", "peach"],
    "colors": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "animals": ["dog", "cat", "horse", "rabbit", "tiger", "eagle", "dolphin", "elephant"],
    "vegetables": ["carrot", "potato", "onion", "spinach", "pepper", "cabbage", "lettuce", "pea"],
    "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"],
    "instruments": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "cello", "harp"],
}
_SYNONYMS = {"happy": ("glad", "sad"), "big": ("large", "small"), "fast": ("quick", "slow"),
             "cold": ("chilly", "hot"), "smart": ("clever", "foolish"), "begin": ("start", "end"),
             "easy": ("simple", "hard"), "strong": ("powerful", "weak"), "old": ("ancient", "new")}


def _instruction(rng: random.Random) -> list[tuple[str, str]]:
    kind = rng.randrange(7)
    if kind == 0:
        w = rng.choice(_WORDS)
        return [(f"Reverse the word \"{w}\".", f"The word \"{w}\" reversed is \"{w[::-1]}\".")]
    if kind == 1:
        ws = rng.sample(_WORDS, rng.randint(3, 5))
        return [(f"Sort these words alphabetically: {', '.join(ws)}.",
                 f"Sorted alphabetically: {', '.join(sorted(ws))}.")]
    if kind == 2:
        ws = rng.sample(_WORDS, 2)
        phrase = " ".join(ws)
        return [(f"Convert \"{phrase}\" to upper case.", f"\"{phrase}\" in upper case is \"{phrase.upper()}\".")]
    if kind == 3:
        cat = rng.choice(sorted(_CATEGORIES))
        picks = rng.sample(_CATEGORIES[cat], 3)
        return [(f"List three {cat}.", f"Here are three {cat}: {picks[0]}, {picks[1]} and {picks[2]}.")]
    if kind == 4:
        n = rng.randint(0, 999)
        return [(f"Write the number {n} in words.", f"The number {n} in words is {number_words(n)}.")]
    if kind == 5:
        w = rng.choice(_WORDS)
        return [(f"How many letters are in the word \"{w}\"?", f"The word \"{w}\" has {len(w)} letters.")]
    word = rng.choice(sorted(_SYNONYMS))
    syn, ant = _SYNONYMS[word]
    return [(f"Give me a synonym for \"{word}\".", f"A synonym for \"{word}\" is \"{syn}\"."),
            ("And an antonym?", f"An antonym for \"{word}\" is \"{ant}\".")]


_GENERATORS = {"math": _math, "code": _code, "instruction": _instruction}


def generated_rows(sizes: dict[str, int] = SIZES, seed: int = GENERATOR_SEED) -> Iterator[dict]:
    """`sizes[task]` distinct conversations per task (the generators repeat themselves otherwise).
    The default seed gives the packaged corpus; other seeds give fresh rows from the same generators."""
    rng = random.Random(seed)
    for task, n in sizes.items():
        seen: set[tuple] = set()
        for _ in range(50 * n):
            if len(seen) == n:
                break
            pairs = tuple(_GENERATORS[task](rng))
            if pairs in seen:
                continue
            seen.add(pairs)
            turns = []
            for q, a in pairs:
                turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            yield {"conversations": turns, "source": f"generated/{task}", "task": task}


def builtin_chat_rows() -> Iterator[dict]:
    yield from chatterbot_rows()
    yield from generated_rows()
