"""Training data for a draft head, made on this machine (nothing is downloaded).

Two sources, as EAGLE-3 trains on (its target's responses to chat prompts):
- self-distillation: the target's own greedy responses to instruction prompts
  built from templates (stories, explanations, lists, emails, code) and to
  copy / summarise prompts over Python standard-library docstrings;
- teacher-forced text found here: standard-library source files.

Then one target pass per sequence returns what the head learns from: the
target's features (its chosen layers' hidden states) and its logits over the
draft vocabulary, for every position.
"""
from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

# Topics and templates for self-distillation prompts. The benchmark prompts
# (../shared/bench/prompts.jsonl) are held out: none of their subjects is here.
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
         "parses a date in YYYY-MM-DD format", "finds the most common word in a text",
         "removes duplicates from a list while keeping order", "converts Celsius to Fahrenheit",
         "validates an email address with a regular expression", "computes the median of a list"]
_TEMPLATES = [(_STORY, "Write a short story about {}."), (_EXPLAIN, "Explain how {} works, in simple terms."),
              (_TIPS, "Give me some tips for {}."), (_CODE, "Write a Python function that {}, with a few tests."),
              (_EXPLAIN, "What are the pros and cons of {}?"), (_STORY, "Write a poem about {}.")]


def instruction_prompts() -> list[str]:
    prompts = [tpl.format(topic) for topics, tpl in _TEMPLATES for topic in topics]
    prompts += [f"Write a polite email to {who} asking {what}." for who, what in _EMAIL]
    return prompts


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)


def docstrings(limit: int, seed: int = 0) -> list[str]:
    """Module and function docstrings of the standard library, 200-900 characters."""
    found = []
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]:
            doc = ast.get_docstring(node)
            if doc and 200 <= len(doc) <= 900:
                found.append(doc)
    random.Random(seed).shuffle(found)
    return found[:limit]


def grounded_prompts(limit: int, seed: int = 0) -> list[str]:
    verbs = ["Copy the following text exactly, word for word:", "Summarize the following text in two sentences:",
             "Rewrite the following text as a bulleted list, reusing its wording:",
             "Answer using only the text below: what does it describe?"]
    return [f"{verbs[i % len(verbs)]}\n\n{doc}" for i, doc in enumerate(docstrings(limit, seed))]


def source_chunks(tokenize: Callable[[str], list[int]], limit: int, length: int, seed: int = 0) -> list[list[int]]:
    """Teacher-forced text: `limit` chunks of `length` tokens of standard-library source."""
    files = _stdlib_files()
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


@dataclass
class Example:
    tokens: np.ndarray  # [T] int64
    features: np.ndarray  # [T, F] float16: the target's chosen layers at each position
    labels: np.ndarray  # [T, N] float16: the target's logits over the draft vocabulary at each position


def target_pass(runner, sequences: list[list[int]], draft_ids: np.ndarray, progress=None) -> list[Example]:
    """One forward of the target per sequence (features and logits of every row)."""
    out = []
    for i, seq in enumerate(sequences):
        sid = runner.allocate(len(seq))
        try:
            logits = runner.forward(sid, seq, 0, len(seq))
            feats = runner.take_features(sid)
        finally:
            runner.release(sid)
        out.append(Example(np.asarray(seq, dtype=np.int64), feats.astype(np.float16),
                           logits[:, draft_ids].astype(np.float16)))
        if progress is not None:
            progress(i)
    return out
