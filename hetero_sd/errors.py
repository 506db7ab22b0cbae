"""Public error types (defined in the IR layer so every layer can raise them)."""
from hetero_sd.ir.errors import (  # noqa: F401
    BackendError,
    ConfigError,
    ConstraintError,
    GenerationError,
    HeteroSDError,
    KVBudgetError,
    ModelLoadError,
)


def describe(exc: BaseException) -> str:
    """One line for an event log: the error's class and message, bounded."""
    return f"{type(exc).__name__}: {exc}"[:300]
