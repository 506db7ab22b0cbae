"""Constrained decoding: JSON Schema, any JSON, regex and grammars, under speculation.

    from hetero_sd.constraint import Constraint
    engine.generate(prompt, constraint=Constraint.json_schema(schema))

spec.py says what a constraint is (and finds a user's errors without a
tokenizer), guide.py enforces one token by token (llguidance), rounds.py
fits it into the speculative round without changing a single output token.
"""
from hetero_sd.constraint.spec import KINDS, Constraint, read_source

__all__ = ["KINDS", "Constraint", "read_source"]
