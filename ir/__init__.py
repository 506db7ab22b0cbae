"""hetero_sd.ir: what a model is and what a unit of work is."""
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.work import (
    MAX_DRAFT_TOKENS,
    DraftRequest,
    DraftResult,
    VerifyRequest,
)


def __getattr__(name):
    # Lazy: the model half needs torch; processes that only exchange work records
    # (transport workers, the scheduler) must not pay for importing it.
    if name in ("ModelIR", "load_model_ir", "reference_logits"):
        from hetero_sd.ir import model

        return getattr(model, name)
    raise AttributeError(f"module 'hetero_sd.ir' has no attribute {name!r}")


__all__ = [
    "ModelConfig", "ModelIR", "ModelLoadError", "load_model_ir", "reference_logits",
    "MAX_DRAFT_TOKENS", "DraftRequest", "DraftResult", "VerifyRequest",
]
