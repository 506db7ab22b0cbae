"""hetero_sd.scheduler: who drafts, who verifies, how far ahead. Never touches a tensor."""
from hetero_sd.scheduler.draft_length import FixedDraftLength

__all__ = ["FixedDraftLength"]
