"""hetero_sd.scheduler: who drafts, who verifies, how far ahead. Never touches a tensor."""
from hetero_sd.scheduler.acceptance import AcceptanceTracker
from hetero_sd.scheduler.cost_model import (DRAFT_KINDS, CostCurve, DeviceProfile, DraftOption, Placement, RoundCost,
                                            Workload, expected_tokens, tokens_per_round)
from hetero_sd.scheduler.draft_length import AdaptiveDraftLength, FixedDraftLength
from hetero_sd.scheduler.mode import RequestMode
from hetero_sd.scheduler.round import DraftLengthPolicy, Round
from hetero_sd.scheduler.splitter import Candidate, Constraints, Plan, Problem, plan, replan, replan_if_drifted

__all__ = ["DRAFT_KINDS", "AcceptanceTracker", "AdaptiveDraftLength", "Candidate", "Constraints", "CostCurve", "DeviceProfile",
           "DraftLengthPolicy", "DraftOption", "FixedDraftLength", "Placement", "Plan", "Problem", "RequestMode",
           "Round", "RoundCost", "Workload",
           "expected_tokens", "plan", "replan", "replan_if_drifted", "tokens_per_round"]
