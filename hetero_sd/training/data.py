"""Training data for a draft head, made on this machine (nothing is downloaded).

Two sources, as EAGLE-3 trains on (its target's responses to chat prompts):
- self-distillation: the target's own greedy responses to instruction prompts
  built from templates (stories, explanations, lists, emails, code) and to
  copy / summarise prompts over Python standard-library docstrings;
- teacher-forced text found here: standard-library source files.

More teacher-forced text found here (prose as well as code) is in corpus.py.
"""
from __future__ import annotations

import random
from typing import Callable

import numpy as np

from hetero_sd.training.corpus import docstrings_of, stdlib_modules

# Topics and templates for self-distillation prompts. The benchmark prompts
# (hetero_sd/bench/prompts.jsonl and code-prompts.jsonl) are held out: none of their
# subjects is here.
_STORY = ["a clockmaker who loses her memory", "two rival bakers in a small town", "a robot learning to paint",
          "a fox who guards a library", "a sailor stranded on an ice floe", "a child who can hear plants",
          "an astronaut's first day on Mars", "a detective who is afraid of the dark", "a dragon who hoards books",
          "a musician playing in an empty train station", "a gardener and a mysterious seed",
          "a village where it never stops raining", "a retired spy learning to knit", "a cat that runs a hotel"]
_EXPLAIN = ["a heat exchanger", "photosynthesis", "a credit score", "a vaccine", "a hash table", "tides",
            "a solar panel", "compound interest", "the water cycle", "an electric motor", "a search engine",
            "inflation", "a bicycle gear system", "the immune system", "a compiler", "an airplane wing",
            "a blockchain", "a microwave oven", "earthquakes", "public-key encryption"]
_TIPS = ["saving money on groceries", "sleeping better", "learning a new language", "running a first marathon",
         "keeping houseplants alive", "writing a cover letter", "public speaking", "working from home",
         "cooking for a large group", "reducing stress", "taking better photos", "organising a small kitchen"]
_EMAIL = [("a colleague", "to reschedule a meeting"), ("a professor", "for an extension on an essay"),
          ("a neighbour", "to keep the noise down at night"), ("a hotel", "about a lost jacket"),
          ("a customer", "to apologise for a late delivery"), ("a manager", "for a day off next week"),
          ("a plumber", "for a quote to replace a boiler"), ("a school", "about a field trip")]
_CODE = ["reverses the words in a sentence", "counts the vowels in a string", "merges two sorted lists",
         "returns the n-th Fibonacci number", "checks whether a number is prime", "flattens a nested list",
         "converts a binary string to an integer", "finds the most common word in a text",
         "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
         "validates an email address with a regular expression", "computes the median of a list"]
_STORY += ["a baker who can taste emotions", "a lost hiker and a talking owl", "a boy who builds a time machine",
           "a city where everyone sleeps by day", "an old violin with a secret", "a tiny island with one shop",
           "a girl who collects thunderstorms", "a mail carrier on the moon", "a knight afraid of horses",
           "a penguin who wants to fly", "a forgotten toy in an attic", "a chef cooking for a king",
           "a train that never arrives", "a painter who loses her colours", "a whale who sings to ships"]
_EXPLAIN += ["a nuclear reactor", "a rainbow", "the stock market", "a 3D printer", "a thermostat", "GPS",
             "a touch screen", "a jet engine", "wifi", "a battery", "a volcano", "a camera lens", "recycling",
             "an elevator", "a water filter", "the human heart", "a neural network", "a database index",
             "noise-cancelling headphones", "a wind turbine", "the seasons", "a mortgage", "a dishwasher"]
_TIPS += ["staying focused at work", "planning a road trip", "making new friends in a new city",
          "starting a vegetable garden", "writing a novel", "eating more vegetables", "training a puppy",
          "preparing for a job interview", "learning to play the guitar", "moving house", "budgeting for a wedding",
          "staying safe while hiking", "reading more books", "decluttering a wardrobe", "hosting a dinner party"]
_EMAIL += [("a teacher", "about a child's homework"), ("a gym", "to cancel a membership"),
           ("a client", "to follow up on an unpaid invoice"), ("a friend", "to invite them to a birthday party"),
           ("a council office", "about a broken street light"), ("an airline", "about a delayed refund"),
           ("a recruiter", "to thank them after an interview"), ("a supplier", "to confirm an order")]
_CODE += ["sorts a list of dictionaries by a key", "reads a CSV file and sums a column", "implements a stack class",
          "computes the factorial of a number iteratively", "finds all anagrams of a word in a list",
          "converts a Roman numeral to an integer", "checks whether brackets in a string are balanced",
          "implements binary search", "counts word frequencies in a file", "generates all permutations of a list",
          "computes the greatest common divisor of two numbers", "transposes a matrix",
          "capitalises the first letter of every word", "groups a list of words by their first letter",
          "implements a queue with two stacks", "returns the longest common prefix of a list of strings"]
_TEMPLATES = [(_STORY, "Write a short story about {}."), (_EXPLAIN, "Explain how {} works, in simple terms."),
              (_TIPS, "Give me some tips for {}."), (_CODE, "Write a Python function that {}, with a few tests."),
              (_EXPLAIN, "What are the pros and cons of {}?"), (_STORY, "Write a poem about {}."),
              (_EXPLAIN, "Describe the history of {}."), (_TIPS, "Write a step-by-step guide to {}."),
              (_CODE, "Write a JavaScript function that {}."), (_STORY, "Write the opening paragraph of a novel about {}."),
              (_EXPLAIN, "Explain {} to a ten-year-old."), (_TIPS, "What are common mistakes people make when {}?"),
              (_CODE, "Explain, step by step, how to write a program that {}.")]


_KINDS = {id(_STORY): "story", id(_EXPLAIN): "explain", id(_TIPS): "tips", id(_CODE): "code"}
PROMPT_KINDS = ("story", "explain", "tips", "email", "code")


def instruction_prompts(kinds: tuple[str, ...] = PROMPT_KINDS) -> list[str]:
    """Self-distillation prompts of the given kinds (what their topics are about)."""
    prompts = [tpl.format(topic) for topics, tpl in _TEMPLATES if _KINDS[id(topics)] in kinds for topic in topics]
    if "email" in kinds:
        prompts += [f"Write a polite email to {who} asking {what}." for who, what in _EMAIL]
    return prompts


def docstrings(limit: int, seed: int = 0) -> list[str]:
    """Module and function docstrings of the standard library, 200-900 characters."""
    found = [doc for path in stdlib_modules() for _, doc in docstrings_of(path) if 200 <= len(doc) <= 900]
    random.Random(seed).shuffle(found)
    return found[:limit]


def grounded_prompts(limit: int, seed: int = 0) -> list[str]:
    verbs = ["Copy the following text exactly, word for word:", "Summarize the following text in two sentences:",
             "Rewrite the following text as a bulleted list, reusing its wording:",
             "Answer using only the text below: what does it describe?"]
    return [f"{verbs[i % len(verbs)]}\n\n{doc}" for i, doc in enumerate(docstrings(limit, seed))]


def source_chunks(tokenize: Callable[[str], list[int]], limit: int, length: int, seed: int = 0) -> list[list[int]]:
    """Teacher-forced text: `limit` chunks of `length` tokens of standard-library source."""
    files = stdlib_modules()
    random.Random(seed).shuffle(files)
    chunks: list[list[int]] = []
    for path in files:
        ids = tokenize(path.read_text(encoding="utf-8", errors="replace"))
        chunks += [ids[i:i + length] for i in range(0, len(ids) - length, length * 4)]
        if len(chunks) >= limit:
            break
    return chunks[:limit]


def draft_vocab(sequences: list[list[int]], size: int, vocab: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` most frequent target ids in the data (EAGLE-3's reduced vocabulary), ascending;
    `always` (EOS) included."""
    counts = np.zeros(vocab, dtype=np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(seq, dtype=np.int64), 1)
    counts[list(always)] = counts.max() + 1
    order = np.argsort(-counts, kind="stable")[:min(size, vocab)]
    return np.sort(order)
