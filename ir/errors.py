"""Error types shared by every layer.

They live in the lowest layer (the IR) so backends and the scheduler can raise
them without importing the engine; `hetero_sd.errors` re-exports them.
"""


class HeteroSDError(Exception):
    """Base class: every error a user can cause is one of these, with a message
    that names the problem and, where there is a choice, what is allowed."""


class ModelLoadError(HeteroSDError):
    """A model path, file or tensor could not be read as a supported model."""


class ConfigError(HeteroSDError):
    """A YAML file or an option is malformed or names something unknown."""


class BackendError(HeteroSDError):
    """A backend or device is unknown, absent, or refused the requested work."""


class KVBudgetError(BackendError):
    """A KV-cache pool cannot hold what was asked of it."""


class GenerationError(HeteroSDError):
    """A request cannot be served as asked (too long a prompt, ...). `partial`: the
    GenerationResult produced before it, when generation had begun."""

    partial = None


class ConstraintError(ConfigError):
    """A grammar, regex or JSON Schema that cannot constrain generation
    (a syntax error, an invalid or unsatisfiable schema), found before any token."""


def from_text(text: str, where: str, fallback: type[Exception]) -> Exception:
    """An error that crossed a process boundary as "ErrorClass: message" (a worker's
    reply, a Ray actor's report), rebuilt as the same HeteroSDError class where it is
    one, else as `fallback`; `where` says which process it came from."""
    cls_name, _, message = text.partition(": ")
    cls = globals().get(cls_name)
    if isinstance(cls, type) and issubclass(cls, HeteroSDError):
        return cls(f"{where}: {message}")
    return fallback(f"{where} failed: {text}")
