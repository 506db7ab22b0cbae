"""One row of the overlap benchmarks (benchmarks/bench_overlap.py, benchmarks/gpu/bench_overlap_gpu.py):
a ControlledDrafter's rounds drafted then verified, and drafted during the verify, side by side."""
from __future__ import annotations

from hetero_sd.engine import Engine
from hetero_sd.testing.controlled import ControlledDrafter


def serial_and_overlapped(target, prompt: list[int], oracle: list[int], a: float, step_s: float, k: int,
                          overlap: str = "auto") -> dict:
    """One benchmark row's measurements: draft-then-verify (overlap off) and drafting during
    the verify (`overlap`), each with a fresh ControlledDrafter; tok/s, the share of drafting
    hidden, the rounds a pre-draft served, acceptance, and whether the output equals `oracle`
    (the target-only greedy output)."""
    row = {}
    for name, mode in (("serial", "off"), ("overlap", overlap)):
        drafter = ControlledDrafter(prompt, oracle, target.vocab_size, a, step_s)
        res = Engine(target, drafter, k=k, overlap=mode).generate_ids(prompt, len(oracle))
        st = res.stats
        row.update({f"{name}_lossless": res.token_ids == oracle, f"{name}_tok_s": st.tokens_per_s,
                    f"{name}_hidden": st.hidden_share, f"{name}_acceptance": st.acceptance_rate,
                    f"{name}_hits": st.predraft_hits / st.rounds if st.rounds else 0.0})
    return row


__all__ = ["serial_and_overlapped"]
