"""Drafting: everything that proposes tokens for the target to verify.

    base.py     the Drafter contract (required methods, declared optional capabilities),
                the request's context (read in process, rebuilt from deltas elsewhere)
    ngram.py    prompt lookup (model-free)
    suffix.py   suffix decoding (model-free) over two trees:
    suffix_tree.py    this request's prompt and output so far
    suffix_global.py  earlier requests' outputs, shared by forks
    model.py    a draft model on any backend
    head.py     an EAGLE-3 head over the target's hidden states
    hybrid.py   suffix drafts where the text repeats, the head elsewhere
    cascade.py  k-stage cascades: each stage verifies the one inside it
    specs.py    the drafter spec tree a config or a plan becomes
    build.py    build_drafter(spec, ...): the one place drafters are constructed
    remote.py   a drafter in a worker process (RemoteDrafter), supervised
    worker.py   the worker process's loop (and asynchronous drafting ahead)
    wire.py     what RemoteDrafter and its worker say to each other

No module here imports the engine: acceptance rules live in hetero_sd.sampling.
"""
from hetero_sd.drafting.base import Drafter, apply_delta, common_prefix
from hetero_sd.drafting.cascade import CascadeDrafter
from hetero_sd.drafting.model import ModelDrafter
from hetero_sd.drafting.ngram import NgramDrafter
from hetero_sd.drafting.specs import CascadeSpec, DrafterSpec, ModelSpec, NgramSpec, WorkerSpec
from hetero_sd.drafting.suffix import SuffixDrafter

__all__ = ["CascadeDrafter", "CascadeSpec", "Drafter", "DrafterSpec", "ModelDrafter", "ModelSpec", "NgramDrafter",
           "NgramSpec", "SuffixDrafter", "WorkerSpec", "apply_delta", "common_prefix"]
