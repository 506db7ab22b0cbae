"""How the ONNX lowering holds weights: streamed to an external data file one
tensor at a time, as fp32, as onnxruntime's own block quantization (int8/int4),
or as the GGUF file's own blocks (`gguf`).

Memory stays bounded by the largest tensor: a weight is read (or dequantized),
converted and written to `weights.bin` before the next is touched, and the
graph proto holds only references to it (ONNX's external data). So a 7B model
builds in a few GB where the in-memory proto took 4x the model.

Linear layers become MatMulNBits (com.microsoft), which onnxruntime runs and
OpenVINO's ONNX frontend reads into compressed constants:
  int8 / int4  the fp32 weight quantized per tensor by onnxruntime's own kernel
               (4-bit: blocks of 128 with zero points where every K allows,
               else symmetric blocks of 32; 8-bit symmetric, blocks of 32,
               int4's LM head 64 beside blocks of 128; the LM head at 8 bits,
               4 breaks it; requant_block);
  gguf         the file's integers and scales as they are (ir/quant.py): an
               integer zero point where the block type has one; where it has
               a per-block minimum (Q4_K, Q5_K, Q4_1, Q5_1), zero point 0 and
               the minimum applied as its own small matmul,
                 x . (q*s - m)^T = MatMulNBits(x; q, s) - blocksum(x) . m^T,
               since onnxruntime's float zero points run ~50x slower (measured)
               and its 8-bit kernel refuses them. The weights are then the
               file's weights bit for bit; no float copy of them exists.
               With our ops (native): Q4_K / Q6_K layers are GGUFMatMul on the
               file's super-blocks (gguf_pack.py), Q4_1's minimum BlockMatMul's
               offsets input; no side matmul.
"""
from __future__ import annotations

from functools import cached_property
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from hetero_sd.backends import gguf_pack
from hetero_sd.backends.native import DOMAIN as NATIVE_DOMAIN, GGUF_TYPES, gguf_fits, gguf_pairs, matmul_fits
from hetero_sd.ir import quant

EXTERNAL_MIN = 1024  # bytes: smaller constants stay inside the proto
ALIGN = 4096  # external offsets page-aligned, so a runtime may map them
ACCURACY_LEVEL = 4  # int8 compute over int weights: measured row-invariant and fast
ROWS_PER_CHUNK = 8192  # rows converted at a time for vocabulary-sized tensors


class Builder:
    """Nodes and initializers of one graph; large initializers go to `data_path`."""

    def __init__(self, data_path=None):
        self.nodes, self.inits, self._n = [], [], 0
        self.domains: set[str] = set()  # custom-op domains the nodes use (backends/native)
        self._data = open(data_path, "wb") if data_path is not None else None
        self._location = data_path.name if data_path is not None else None

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value, hint="c", dtype=None) -> str:
        arr = np.asarray(value, dtype=dtype)
        if self._data is None or arr.nbytes < EXTERNAL_MIN:
            name = self.name(hint)
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        return self.const_stream(hint, arr.shape, arr.dtype, [arr])

    def const_stream(self, hint: str, shape, dtype, chunks: Iterable[np.ndarray]) -> str:
        """A constant written piece by piece (row chunks in C order), never whole in memory."""
        name = self.name(hint)
        if self._data is None:
            arr = np.concatenate([np.asarray(c, dtype=dtype).ravel() for c in chunks]).reshape(shape)
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        start = -(-self._data.tell() // ALIGN) * ALIGN
        self._data.seek(start)
        for chunk in chunks:
            self._data.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
        length = self._data.tell() - start
        expect = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if length != expect:
            raise AssertionError(f"constant {name}: wrote {length} bytes, shape needs {expect}")
        t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                             dims=list(shape), data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self._location), ("offset", str(start)), ("length", str(length))):
            t.external_data.add(key=key, value=value)
        self.inits.append(t)
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, domain: str = "", **attrs) -> str:
        out = out or self.name(op_type.lower())
        if domain not in ("", "com.microsoft"):
            self.domains.add(domain)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, domain=domain or None, **attrs))
        return out

    def close(self) -> None:
        if self._data is not None:
            self._data.close()


def wide_blocks(cfg) -> bool:
    """Do int4's 4-bit weights take blocks of 128 (requant_block)? Only where every linear
    layer's K is a multiple of 128: a model with some layers in shorter blocks pays for
    the padding those need without their gain (SmolLM2, hidden 576: decode 0.92x
    llama-bench with blocks of 64 and 128, padded, against 0.97x with 32, unpadded)."""
    ks = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
    return all(k % 128 == 0 for k in ks)


def requant_block(k: int, bits: int, head: bool = False, wide: bool = False) -> int:
    """The block length int4/int8 re-quantize to along K. 4-bit, where the model allows
    (wide_blocks): 128, with integer zero points. On the 1.5B (AMD EPYC, AVX-512) blocks
    of 128 decoded 1.12x and prefilled 1.44x faster than blocks of 32 side by side, every
    verify row cheaper (fewer scales to apply per int8 dot product), at a KL to the
    file's own blocks of 0.055 against 0.037 and the same top-1 agreement
    (docs/backends.md). Their odd-width calls round the last row apart on such hosts:
    the row check pads them (row_check.py). Otherwise 32, symmetric. int4's 8-bit LM
    head (head=True) of a wide model: 64 (exact at every width where measured, and
    faster than 32); int8's weights stay in blocks of 32 (64 moved a tiny Gemma 3's
    logits past the tests' bound)."""
    if wide and k % 128 == 0:
        return 128 if bits == 4 else 64 if head else 32
    return 32


class Linears:
    """y = x W^T (+ bias) for weights named in Hugging Face terms, in one precision.
    `names` lists weights whose output rows are concatenated (q/k/v, gate/up):
    one wider matmul where their formats agree."""

    def __init__(self, b: Builder, weights, precision: str, wide: bool = False, native: bool = False,
                 pairs: bool | None = None):
        """native: block-quantized weights run by our BlockMatMul where it covers their
        shape (backends/native/block_matmul.c: one row computed alike at any width),
        on the same inputs MatMulNBits would take."""
        if precision not in ("fp32", "int8", "int4", "gguf"):
            raise ValueError(f"no ONNX weight policy for precision {precision!r}")
        if precision == "gguf" and not weights.has_blocks:
            raise ValueError("precision 'gguf' needs a GGUF model (it keeps the file's own blocks)")
        self.b, self.weights, self.precision, self.wide, self.native = b, weights, precision, wide, native
        self._given_pairs = pairs  # GGUFMatMul's weight packing (None: the default build's)

    def float_weight(self, name: str) -> np.ndarray:
        return self.weights.get(name).numpy()

    def __call__(self, x: str, names: list[str], bias: np.ndarray | None = None, head: bool = False,
                 out: str | None = None, rows: int | None = None) -> str:
        """`rows`: keep only the first output rows (a restricted LM head; one name)."""
        if self.precision == "gguf":
            y, bias = self._gguf(x, names, rows, bias), None  # (the bias added there)
        else:
            w = np.concatenate([self.float_weight(n) for n in names]) if len(names) > 1 else \
                self.float_weight(names[0])[:rows]
            if self.precision == "fp32":
                y = self._float_matmul(x, w)
            else:
                y = self._requantized(x, w, 8 if head or self.precision == "int8" else 4)
        if bias is not None:
            y = self.b.op("Add", y, self.b.const(bias.astype(np.float32), "b"))
        return self.b.op("Identity", y, out=out) if out else y

    def _float_matmul(self, x: str, w: np.ndarray) -> str:
        return self.b.op("MatMul", x, self.b.const(np.ascontiguousarray(w.T, dtype=np.float32), "w"))

    # -- int8 / int4: onnxruntime's block quantizer, one tensor at a time
    def _requantized(self, x: str, w: np.ndarray, bits: int) -> str:
        from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

        n, k = w.shape
        block = requant_block(k, bits, head=self.precision == "int4", wide=self.wide)
        symmetric = bits == 8 or block == 32
        kb = -(-k // block)
        wt = np.ascontiguousarray(w.T, dtype=np.float32)  # [K, N], the quantizer's layout
        packed = np.zeros((n, kb, block * bits // 8), dtype=np.uint8)
        scales = np.zeros((n, kb), dtype=np.float32)
        zero = np.zeros((n, -(-kb * bits // 8)), dtype=np.uint8)
        (quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits)(packed, wt, scales, zero, block, n, k,
                                                                         symmetric)
        del wt
        return self._matmul_nbits(x, packed, scales, None if symmetric else zero, k, n, bits, block)

    def _matmul_nbits(self, x, packed, scales, zero_points, k, n, bits, block) -> str:
        b = self.b
        ins = [x, b.const(packed, "wq"), b.const(scales.reshape(-1), "ws")]
        if zero_points is not None:
            ins.append(b.const(zero_points, "wz"))
        if self.native and matmul_fits(k, bits, block):
            return b.op("BlockMatMul", *ins, domain=NATIVE_DOMAIN, K=k, N=n, bits=bits, block_size=block)
        return b.op("MatMulNBits", *ins, domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
                    accuracy_level=ACCURACY_LEVEL)

    # -- gguf: the file's blocks
    def _gguf(self, x: str, names: list[str], rows: int | None = None, bias: np.ndarray | None = None) -> str:
        """Runs of names in one block format fuse into one matmul; a tensor
        stored as floats (or a type with no block form) is an exact fp32 one.
        Each matmul adds its rows' part of `bias` (GGUFMatMul in the op itself)."""
        outs, run = [], []
        done = 0  # output rows so far (where each matmul's part of the bias starts)

        def part(n: int) -> np.ndarray | None:
            nonlocal done
            done += n
            return None if bias is None else bias[done - n:done]

        def flush():
            if run:
                blk = run[0] if len(run) == 1 else _stack(run)
                outs.append(self.blocks_matmul(x, blk, part(blk.shape[0])))
                run.clear()

        for name in names:
            blk = self.weights.blocks(name)
            if blk is None:
                flush()
                w = self.float_weight(name)[:rows]
                outs.append(self._add(self._float_matmul(x, w), part(w.shape[0])))
                continue
            blk = blk if rows is None else blk.rows(0, rows)
            if run and _format(run[0]) != _format(blk):
                flush()
            run.append(blk)
        flush()
        return outs[0] if len(outs) == 1 else self.b.op("Concat", *outs, axis=-1)

    def _add(self, y: str, bias: np.ndarray | None) -> str:
        return y if bias is None else self.b.op("Add", y, self.b.const(bias.astype(np.float32), "b"))

    def _ours(self, blk: quant.Blocks | None) -> bool:
        """Whether our GGUFMatMul computes on these blocks (the file's own super-blocks)."""
        return blk is not None and self.native and gguf_fits(blk.kind, blk.shape[1]) and blk.raw is not None

    def gated(self, x: str, names: list[str], act: str) -> str | None:
        """act(x G^T) * (x U^T) for names [gate, up], as one GGUFMatMul (its gated form),
        or None where that op does not cover it (the caller then runs the matmul, split
        and activation)."""
        if self.precision != "gguf" or act != "silu" or len(names) != 2:
            return None
        g, u = (self.weights.blocks(name) for name in names)
        if not (self._ours(g) and self._ours(u)) or g.kind != u.kind or g.shape != u.shape:
            return None
        n, k = g.shape
        # one op: no [T, 2N] tensor, no split, activation or product as nodes of their own
        packed = gguf_pack.pack_gated(g.kind, g.raw, u.raw, pairs=self._pairs)
        return self._gguf_op([x, self.b.const(packed, "wg")], k, n, g.kind, gated=1)

    def blocks_matmul(self, x: str, blk: quant.Blocks, bias: np.ndarray | None = None) -> str:
        n, k = blk.shape
        if self._ours(blk):
            # our GGUFMatMul computes on the file's own super-blocks, 8 columns interleaved
            # (gguf_pack.py): a weight costs the file's bits, its scales apply in integers
            ins = [x, self.b.const(gguf_pack.pack(blk.kind, blk.raw, pairs=self._pairs), "wg")]
            if bias is not None:  # added in the op: no node of its own
                ins.append(self.b.const(bias.astype(np.float32), "b"))
            return self._gguf_op(ins, k, n, blk.kind)
        return self._add(self._nbits_blocks(x, blk), bias)

    def _gguf_op(self, ins: list[str], k: int, n: int, kind: str, **attrs) -> str:
        """GGUFMatMul, saying how the weights were packed for the library built here."""
        return self.b.op("GGUFMatMul", *ins, domain=NATIVE_DOMAIN, K=k, N=n, type=GGUF_TYPES[kind],
                         pairs=int(self._pairs), **attrs)

    @cached_property
    def _pairs(self) -> bool:
        """The packing GGUFMatMul reads: as the lowering was told (export_onnx: the library
        its options build), else the default build's."""
        return gguf_pairs() if self._given_pairs is None else self._given_pairs

    def _nbits_blocks(self, x: str, blk: quant.Blocks) -> str:
        """The blocks as MatMulNBits' (or our BlockMatMul's) inputs."""
        n, k = blk.shape
        q = blk.q
        zero_points = None
        if blk.offset is not None:  # the minimum goes to its own matmul: zero point 0 here
            zero_points = np.zeros((n, -(-(k // blk.block) * blk.bits // 8)), dtype=np.uint8)
        elif blk.bits == 8 and blk.zero != 128:
            q = q + np.uint8(128 - blk.zero)  # the default zero point 128: no zero-point input (exact)
        elif blk.bits == 4 and blk.zero != 8:
            zero_points = _pack4(np.full((n, k // blk.block), blk.zero, dtype=np.uint8))
        packed = (_pack4(q) if blk.bits == 4 else q).reshape(n, k // blk.block, -1)
        y = self._matmul_nbits(x, packed, blk.scale, zero_points, k, n, blk.bits, blk.block)
        if blk.offset is None:
            return y
        b = self.b
        sums = b.op("ReduceSum", b.op("Reshape", x, b.const([0, -1, blk.block], dtype=np.int64)),
                    b.const([-1], dtype=np.int64), keepdims=0)  # [T, K / block]
        return b.op("Sub", y, b.op("MatMul", sums, b.const(np.ascontiguousarray(blk.offset.T), "wm")))

    def embedding(self, name: str) -> str:
        """The token table for Gather: fp32 (the GGUF's blocks dequantized exactly,
        in row chunks, so the float copy never sits whole in memory)."""
        blk = self.weights.blocks(name) if self.precision == "gguf" else None
        if blk is None:
            return self.b.const(self.float_weight(name), "embed")
        rows = blk.shape[0]
        chunks = (quant.dequantize(blk.rows(i, i + ROWS_PER_CHUNK)) for i in range(0, rows, ROWS_PER_CHUNK))
        return self.b.const_stream("embed", blk.shape, np.float32, chunks)


def _pack4(q: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte, the even one in the low nibble (MatMulNBits' order)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _stack(blocks: list[quant.Blocks]) -> quant.Blocks:
    first = blocks[0]
    cat = lambda f: np.concatenate([f(b) for b in blocks])  # noqa: E731
    return quant.Blocks(first.bits, first.block, cat(lambda b: b.q), cat(lambda b: b.scale), first.zero,
                        None if first.offset is None else cat(lambda b: b.offset), first.kind,
                        None if any(b.raw is None for b in blocks) else cat(lambda b: b.raw))


def _format(blk: quant.Blocks) -> tuple:
    """What must agree for blocks to share one matmul (GGUFMatMul reads one GGUF type)."""
    return blk.bits, blk.block, blk.zero, blk.offset is None, blk.kind
