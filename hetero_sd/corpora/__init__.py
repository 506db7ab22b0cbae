"""Suffix corpora shipped with the package, one file per target file stem
(spec.packaged_corpus): a target's own greedy answers to the built-in
self-distillation prompts, made by `hetero-sd build-corpus` (each file's
metadata says how). `drafter.suffix_corpus: auto` reads the one built on this
machine first, and one of these where none was built.
"""
