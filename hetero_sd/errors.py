"""Public error types (defined in the IR layer so every layer can raise them)."""
from hetero_sd.ir.errors import (  # noqa: F401
    BackendError,
    ConfigError,
    GenerationError,
    HeteroSDError,
    KVBudgetError,
    ModelLoadError,
)
