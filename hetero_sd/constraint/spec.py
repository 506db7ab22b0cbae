"""What a constraint is, independent of the library that enforces it.

    Constraint.json_schema({"type": "object", ...})   # or the schema's JSON text
    Constraint.any_json()                             # any JSON object
    Constraint.regex(r"[0-9]{3}-[0-9]{4}")
    Constraint.grammar(text)                          # GBNF (llama.cpp) or Lark EBNF

`check()` finds every error a user can make in one (JSON that does not parse,
a schema `jsonschema` rejects, a regex or grammar with a syntax error, a
schema no value satisfies) before any model loads: it needs no tokenizer.
Errors name `where` the constraint came from (a CLI flag, a YAML key).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.ir.errors import ConstraintError

KINDS = ("json_schema", "json", "regex", "grammar")
_ANY_JSON_OBJECT = {"type": "object"}  # what OpenAI's response_format json_object promises


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    source: str = ""  # the schema's JSON text, the regex, or the grammar text ("" for json)
    where: str = "constraint"  # for messages: "--regex", "cfg.yaml: generation.constraint.regex"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"{self.where}: unknown constraint kind {self.kind!r}; allowed: {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | str, where: str = "json_schema") -> "Constraint":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), where)

    @classmethod
    def any_json(cls, where: str = "json") -> "Constraint":
        return cls("json", "", where)

    @classmethod
    def regex(cls, pattern: str, where: str = "regex") -> "Constraint":
        return cls("regex", pattern, where)

    @classmethod
    def grammar(cls, text: str, where: str = "grammar") -> "Constraint":
        return cls("grammar", text, where)

    @classmethod
    def of(cls, value, where: str = "constraint") -> "Constraint | None":
        """A Constraint from what the API and YAML accept: a Constraint, None, or a
        mapping with one key of KINDS ({"regex": "..."}, {"json_schema": {...}}, {"json": true})."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, dict) or len(value) != 1:
            raise ConstraintError(f"{where}: give exactly one of {', '.join(KINDS)} "
                                  f"(e.g. {{regex: '[0-9]+'}}), got {value!r}"[:400])
        (kind, body), = value.items()
        if kind not in KINDS:
            raise ConstraintError(f"{where}: unknown constraint kind {kind!r}; allowed: {', '.join(KINDS)}")
        where = f"{where}.{kind}"
        if kind == "json":
            if body is not True:
                raise ConstraintError(f"{where}: must be true (any JSON object), got {body!r}")
            return cls.any_json(where)
        if kind == "json_schema":
            if not isinstance(body, (dict, str)):
                raise ConstraintError(f"{where}: a schema (mapping) or its JSON text, got {type(body).__name__}")
            return cls.json_schema(body, where)
        if not isinstance(body, str) or not body:
            raise ConstraintError(f"{where}: must be a non-empty string, got {body!r}")
        return cls(kind, body, where)

    def schema(self) -> dict:
        """The JSON Schema (json_schema and json kinds)."""
        if self.kind == "json":
            return dict(_ANY_JSON_OBJECT)
        try:
            schema = json.loads(self.source)
        except json.JSONDecodeError as exc:
            raise ConstraintError(f"{self.where}: the JSON Schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"{self.where}: a JSON Schema is an object, got {type(schema).__name__}")
        return schema

    def check(self) -> None:
        """Every error findable without a tokenizer, as one ConstraintError."""
        if self.kind in ("json_schema", "json"):
            import jsonschema

            schema = self.schema()
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                path = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
                raise ConstraintError(f"{self.where}: invalid JSON Schema at {path}: {exc.message}") from None
        from hetero_sd.constraint.guide import check_grammar

        check_grammar(self)

    def describe(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return self.kind if self.kind == "json" else f"{self.kind} {text!r}"


def read_source(value: str, base: Path | None = None) -> str:
    """A CLI or YAML value that may name a file: the file's text when it exists, else the value."""
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        if len(value) < 4096 and "\n" not in value and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    return value
