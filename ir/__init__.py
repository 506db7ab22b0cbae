"""hetero_sd.ir: what a model is and what a unit of work is."""
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.model import ModelIR, load_model_ir, reference_logits
from hetero_sd.ir.work import (
    MAX_DRAFT_TOKENS,
    DraftRequest,
    DraftResult,
    TruncateRequest,
    VerifyRequest,
    VerifyResult,
)

__all__ = [
    "ModelConfig", "ModelIR", "ModelLoadError", "load_model_ir", "reference_logits",
    "MAX_DRAFT_TOKENS", "DraftRequest", "DraftResult", "VerifyRequest", "VerifyResult",
    "TruncateRequest",
]
