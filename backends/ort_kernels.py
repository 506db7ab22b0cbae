"""Which kernels an onnxruntime graph runs, and why: a typed record that the runner's
`kernel_choice` note is rendered from (never parsed back)."""
from __future__ import annotations

from dataclasses import dataclass, replace

SLAB = "attention by our SlabAttention, compiled for this host"
OURS, GGUF_OURS, THEIRS = "our BlockMatMul", "our BlockMatMul and GGUFMatMul", "MatMulNBits"


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # how attention runs (SLAB, or gathered from the pool and why)
    matmul: str = ""  # who runs the quantized matmuls (OURS, GGUF_OURS, THEIRS); "": float weights
    why: str = ""  # why that matmul ("": nothing to say)

    @classmethod
    def of(cls, slab: bool, why_not: str) -> "KernelChoice":
        """The attention part: our SlabAttention, or gathered from the pool (why not ours)."""
        return cls(SLAB if slab else f"attention gathered from the pool (SlabAttention: {why_not})")

    def matmuls(self, by: str, why: str = "") -> "KernelChoice":
        return replace(self, matmul=by, why=why)

    @property
    def ours(self) -> bool:
        """Whether our matmul runs the quantized layers."""
        return self.matmul in (OURS, GGUF_OURS)

    def describe(self) -> str:
        if not self.matmul:
            return self.attention
        return f"{self.attention}, quantized matmuls by {self.matmul}" + (f" ({self.why})" if self.why else "")
