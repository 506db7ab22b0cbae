"""The onnxruntime backend: the IR lowered to ONNX (cached on disk), run by an
execution provider chosen from the device string: cpu -> CPU, cuda:N -> CUDA,
npu:N -> CANN (Ascend). Weight-only int8/int4 use onnxruntime's own
MatMulNBits quantizer; the LM head stays at 8 bits or more (4-bit breaks it)."""
from __future__ import annotations

import gc
import os
import shutil

from typing import Sequence

import numpy as np

from hetero_sd.backends.base import API_VERSION, BatchItem, DeviceInfo, PrecisionInfo, resolve
from hetero_sd.ir.cache import cache_dir, cached
from hetero_sd.backends.graph_runner import GraphRunner
from hetero_sd.backends.graph_version import GRAPH_VERSION
# native_fits from backends/native, not onnx_native: a warm start must not import onnx
from hetero_sd.backends.native import gguf_pairs, kernel_available, library, native_fits
from hetero_sd.backends.kernel_timing import CHOICE_VERSION, Choice, Timing, cached_choice, choose, time_runner, \
    write_choice
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.backends.ort_kernels import GGUF_OURS, OURS, THEIRS, KernelChoice
from hetero_sd.backends.row_check import NO_EXACT, host_signature, padded
from hetero_sd.backends.ort_varlen import VarlenGraph
from hetero_sd.ir.errors import BackendError
from hetero_sd.ir.model import ModelIR

_PROVIDERS = {"CUDAExecutionProvider": "cuda", "CANNExecutionProvider": "npu"}
_QUANTIZED = ("int8", "int4", "gguf")  # MatMulNBits precisions: one-token calls checked (row_check.py)
_EXACT = "MLAS kernels are row-invariant (tested)"
GGUF_NOTE = ("a GGUF's own blocks, bit-exact: Q4_0/Q4_1/Q4_K as 4-bit, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as "
             "8-bit MatMulNBits, block minimums as their own matmul; F16/BF16 and other types as fp32")


def _cpu_precisions() -> tuple[PrecisionInfo, ...]:
    # MatMulNBits may take a one-row path (AVX2 hosts, blocks of 32) or an odd
    # call's tail (AVX-512 hosts, blocks of 128) that rounds apart from its main
    # kernel: such calls then run one row longer, decided per host by a bitwise
    # check at load (row_check.py).
    checked = "calls padded (one row, or odd widths) as a check at load finds exact on this host"
    return (PrecisionInfo("fp32", True, _EXACT),
            PrecisionInfo("int8", True, f"weight-only MatMulNBits 8-bit; {checked}"),
            PrecisionInfo("int4", True, f"weight-only MatMulNBits 4-bit, blocks of 128 where "
                          f"the model allows, else 32 (LM head 8-bit); {checked}"),
            PrecisionInfo("gguf", True, f"{GGUF_NOTE}; {checked}"))


class OrtBackend:
    """`options` (backends/options.py): the kernels, matmul policy and padding its runners
    use unless a load names its own."""

    name = "onnxruntime"
    api_version = API_VERSION
    takes_options = True

    def __init__(self, options: BackendOptions = DEFAULT_OPTIONS):
        self.options = options

    def probe(self) -> list[DeviceInfo]:
        try:
            import onnxruntime as ort
        except Exception:
            return []
        desc = f"onnxruntime {ort.__version__}"
        # which ops the one-sequence graph runs (a model may still not fit them)
        native, why = kernel_available("matmul", self.options)
        where = " always" if self.options.native_matmul == "always" else \
            " or MatMulNBits, the faster exact path on this host (timed at a model's first load)"
        matmul = f"quantized matmul: our BlockMatMul (a GGUF's blocks: GGUFMatMul){where}" if native else \
            f"quantized matmul: MatMulNBits; BlockMatMul {why}"
        native, why = kernel_available("attention", self.options)
        attention = "attention: our SlabAttention" if native else f"attention: gathered from the pool; SlabAttention {why}"
        devices = [DeviceInfo(self.name, "cpu", f"{desc} CPUExecutionProvider; {matmul}; {attention}",
                              _cpu_precisions(), "fp32")]
        for provider in ort.get_available_providers():
            if provider in _PROVIDERS:
                note = "provider kernels chosen by shape; lossless up to numerics"
                devices.append(DeviceInfo(self.name, f"{_PROVIDERS[provider]}:0", f"{desc} {provider}",
                                          (PrecisionInfo("fp32", False, note),), "fp32"))
        return devices

    def load(self, model: ModelIR, device: str, precision: str, kv_budget_bytes: int,
             progress=None, options: BackendOptions | None = None) -> "OrtRunner":
        info, prec = resolve(self.probe(), self.name, device, precision)
        return OrtRunner(model, info, prec, kv_budget_bytes, progress, options or self.options)


def session_options(threads: int, libraries=()):
    """Options of every session this backend opens. Its threads spin while a run is
    under way (waking them per op costs) but stop when the run returns: a draft
    and a target in one process run in turn, and a pool still spinning after its
    run took a core from the other's (measured on 2 cores: the 1.5B's verify
    1.27x slower beside a spinning SmolLM2 draft, the draft's steps too; one
    session alone decodes at the same speed either way)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    for lib in libraries:  # custom ops (backends/native)
        opts.register_custom_ops_library(str(lib))
    return opts


def export_onnx(model: ModelIR, precision: str, progress=None, attention: str = "slab",
                native_matmul: bool = False, build: bool = True, options: BackendOptions = DEFAULT_OPTIONS):
    """The model's ONNX file for this precision, built once and cached; the
    weights stream to an external file tensor by tensor (onnx_weights.py).
    attention: "slab" (one sequence, OpenVINO), "pool" (several per call, gathered from the
    pool, onnx_batch.py) or "native" (several per call, our SlabAttention on the pool in
    place, onnx_native.py); native_matmul: quantized linear layers by our BlockMatMul
    (backends/native, built as `options` say); build=False: only its path, built or not."""
    from importlib.metadata import version

    import onnxruntime as ort

    cfg = model.config
    extra = {"head": cfg.output_vocab} if cfg.output_vocab else {}
    if attention == "pool":
        extra["batched"] = 1
    elif attention != "slab":
        extra["attention"] = attention
    pairs = None
    if native_matmul:
        extra["matmul"] = "native"
        if precision == "gguf":  # weights packed for the library built here (gguf_pack.py)
            pairs = gguf_pairs(options)
            extra["pairs"] = int(pairs)
    if cfg.feature_layers:  # a graph with the extra output; the key without it is unchanged
        extra["features"] = list(cfg.feature_layers)
    folder = cache_dir("onnx", model.source, graph=GRAPH_VERSION, precision=precision,
                       onnx=version("onnx"), ort=ort.__version__, **extra)

    def lower(path):
        if progress is not None:
            kind = {"pool": " (attention gathered from the pool)", "native": " (SlabAttention)"}.get(attention, "")
            progress(0, 0, f"lowering to ONNX{kind}, {precision} weights (once; cached)")
        build_llama_onnx(model, precision, path, progress, attention=attention, native_matmul=native_matmul,
                         pairs=pairs)

    return cached(folder, "model.onnx", lower) if build else folder / "model.onnx"


def build_llama_onnx(*args, **kwargs):
    """The lowering (onnx_llama.py), imported only to build a graph: a cached one
    loads without onnx or torch."""
    from hetero_sd.backends.onnx_llama import build_llama_onnx as build

    return build(*args, **kwargs)


class OrtRunner(GraphRunner):
    """One graph serves every call, one sequence or a server's batch of many: on the
    CPU our SlabAttention reads every sequence's keys from the pool in place
    (onnx_native.py) where it covers the model and builds here, else the graph that
    gathers them (onnx_batch.py); other providers run the latter. Either way a row
    rounds alike in a one-token call, in any verify and in any batch, so the server
    answers what the command line does, bit for bit (tests/serve/test_paths.py)."""

    can_copy_prefix = True  # every row is row-invariant: copied KV is what a prefill writes
    max_batch = 32  # sequences per call: the server's running set (split above this)

    def __init__(self, model: ModelIR, info: DeviceInfo, precision: PrecisionInfo, kv_budget_bytes: int,
                 progress=None, options: BackendOptions = DEFAULT_OPTIONS):
        super().__init__(model, info, precision, kv_budget_bytes, pad_single_row=precision.name in _QUANTIZED,
                         options=options)
        self._varlen: VarlenGraph | None = None
        self._session = None
        self._progress = progress
        self._native_matmul = False  # BlockMatMul for the quantized layers (_graph_kind)
        self._kernels = KernelChoice("")  # what the graph runs and why (_graph_kind, _load)
        self._open_native: bool | None = None  # the open graph's matmuls: ours, MatMulNBits', none open
        self._load(self._graph_kind() if info.device == "cpu" else "pool")

    def _graph_kind(self) -> str:
        """Our SlabAttention where it covers the model and compiles here (onnx_native.py),
        else attention gathered from the pool; quantized linear layers by our BlockMatMul
        where it is on and compiles here (backends/native), else MatMulNBits.
        kernel_choice says which and why (rendered from self._kernels)."""
        fits, why = native_fits(self._model.config)
        if fits:
            fits, why = kernel_available("attention", self.options)
        self._kernels = KernelChoice.of(fits, why)
        if self.precision.name in _QUANTIZED:
            self._native_matmul, why = kernel_available("matmul", self.options)
            ours = GGUF_OURS if self.precision.name == "gguf" else OURS
            self._kernels = self._kernels.matmuls(ours) if self._native_matmul else \
                self._kernels.matmuls(THEIRS, f"BlockMatMul: {why}")
        return "native" if fits else "pool"

    def _load(self, attention: str) -> None:
        """Open `attention`'s graph. Its quantized matmuls run by
        whichever exact path is the faster on this host, timed once and cached
        (kernel_timing.py): our BlockMatMul (GGUFMatMul for precision gguf's blocks),
        never padded, or MatMulNBits, padded as its row check says. MatMulNBits is timed
        only where some padding makes it exact; where none does, ours runs (a load that
        would fail without it). Measured on a 2-core AMD EPYC with AVX-512: SmolLM2 int4
        (blocks of 32) ran faster by MatMulNBits unpadded (0.96x llama-bench's decode,
        0.85x ours), the 1.5B int4 (blocks of 128, odd calls padded) by ours (0.92-1.00x
        against 0.87x); precision gguf by ours (the 1.5B's Q4_K_M 0.89-0.95x against
        MatMulNBits' 0.56x, whose Q4_K minimums need a side matmul).
        options.native_matmul: always runs ours without timing (tests, experiments)."""
        if not self._native_matmul:
            self._open_graph(attention, native_matmul=False)
            return
        if self.options.native_matmul == "always":
            self._kernels = self._kernels.matmuls(self._kernels.matmul, "native_matmul: always")
            self._open_graph(attention, native_matmul=True)
            return
        ours = "GGUFMatMul" if self.precision.name == "gguf" else "BlockMatMul"
        folder = self._choice_folder(attention)
        choice = cached_choice(folder, (ours, "MatMulNBits"))
        if choice is None:
            theirs = self._their_padding(attention)
            if theirs == NO_EXACT:
                self._kernels = self._kernels.matmuls(self._kernels.matmul, f"MatMulNBits: {NO_EXACT} on this host")
                self._open_graph(attention, native_matmul=True)
                return
            choice = self._time_both(attention, ours, folder)
        self._open_chosen(attention, choice, choice.chosen == ours)

    def _open_chosen(self, attention: str, choice: Choice, native: bool) -> None:
        """Run the timed choice's graph (ours where `native`), opening it unless it is open."""
        why = f"the faster exact path, {choice.describe()}"
        self._kernels = self._kernels.matmuls(self._kernels.matmul if native else THEIRS, why)
        if self._open_native is not native:
            self._open_graph(attention, native_matmul=native)
        else:
            self._note_graph()

    def _time_both(self, attention: str, ours: str, folder) -> Choice:
        """Time MatMulNBits' graph (open: _their_padding checked it) and ours, one after the
        other (one model's weights in memory at a time); cache the faster and delete the
        slower's lowered graph (a large model's is gigabytes; a forced change rebuilds it)."""
        if self._progress is not None:
            self._progress(0, 0, f"timing MatMulNBits against our {ours} on this host (once; cached)")
        if self._open_native is not False:
            self._open_graph(attention, native_matmul=False, note=False)
        timings = [Timing("MatMulNBits", *time_runner(self))]
        self._close_session()
        self._open_graph(attention, native_matmul=True, note=False)
        timings.insert(0, Timing(ours, *time_runner(self)))
        choice = choose(timings)
        write_choice(folder, choice, self._label())
        slower = self._graph_path(attention, choice.chosen != ours, build=False).parent
        if choice.chosen != ours:
            self._close_session()
        shutil.rmtree(slower, ignore_errors=True)
        return choice

    def _choice_folder(self, attention: str):
        """Keyed on the model's files, precision and lowering, both runtimes, the host and
        a forced padding (options.pad_single_row), but not on the graph's extra outputs: the same
        target with and without feature outputs (a head drafter's, and target-only
        decoding) must run the same kernel, so that their logits are bitwise the same."""
        runtimes = [self._runtime(n, attention)[1] for n in (False, True)]
        return cache_dir("kernel-choice", self._model.source, version=CHOICE_VERSION, host=host_signature(),
                         graph=GRAPH_VERSION, precision=self.precision.name, attention=attention,
                         runtimes=runtimes, forced=_forced_key(self.options))

    def _close_session(self) -> None:
        self._session = self._varlen = self._open_native = None
        gc.collect()  # its weights go before the next graph's load

    def _their_padding(self, attention: str) -> str:
        """MatMulNBits' padding on this host: its cached verdict, else its graph opened and
        checked (the verdict, exact or not, is cached; its session is kept where it is exact)."""
        try:
            known = self.cached_padding(self._graph_path(attention, False), self._runtime(False, attention)[1])
        except BackendError:  # cached: no padding makes it exact here
            return NO_EXACT
        if known is not None:
            return known.padding
        try:
            self._open_graph(attention, native_matmul=False, note=False)
            return self._padding
        except BackendError:  # no padding makes it exact here: ours needs none
            self._close_session()
            return NO_EXACT

    def _graph_path(self, attention: str, native_matmul: bool, build: bool = True):
        return export_onnx(self._model, self.precision.name, self._progress, attention=attention,
                           native_matmul=native_matmul, build=build, options=self.options)

    def _runtime(self, native_matmul: bool, attention: str) -> tuple:
        """(our compiled library or none, the runtime string the row check keys on: the
        verdict is the graph's and its kernels', our op's build too, its folder names its hash)."""
        import onnxruntime as ort

        libraries = (library("matmul" if native_matmul else "attention", self.options),) \
            if native_matmul or attention == "native" else ()
        built = "".join(f" {lib.parent.name}" for lib in libraries)
        return libraries, f"onnxruntime {ort.__version__} {self.device.device}{built}"

    def _open_graph(self, attention: str, native_matmul: bool, note: bool = True) -> None:
        path = self._graph_path(attention, native_matmul)
        self._libraries, runtime = self._runtime(native_matmul, attention)
        self._session = self._open(path)
        self._open_native = native_matmul
        self._outputs = [o.name for o in self._session.get_outputs()]
        features = len(self.feature_layers) * self._model.config.hidden_size
        self._varlen = VarlenGraph(self._session, self._pool, self.vocab_size, features) \
            if attention == "native" else None
        self._graph_note = self._padding_note = ""
        self._padding = "pairs" if self._checks_rows else "none"  # each graph is checked on its own
        self.settle_padding(path, runtime)
        if note:
            self._note_graph()

    def _note_graph(self) -> None:
        self._graph_note = f"{self._kernels.describe()}, any sequences a call"

    def allocate(self, capacity: int) -> int:
        # a padded call (row_check.py) writes its extra row's K/V one slot past the sequence
        return super().allocate(capacity + (self._varlen is not None and self._padding != "none"))

    def _open(self, path):
        import onnxruntime as ort

        opts = session_options(len(os.sched_getaffinity(0)), self._libraries)
        provider = next((p for p, d in _PROVIDERS.items() if self.device.device.startswith(d)),
                        "CPUExecutionProvider")
        return ort.InferenceSession(str(path), opts, providers=[provider])

    def forward(self, seq_id: int, tokens: Sequence[int], start: int, num_logits: int) -> np.ndarray:
        return self.forward_batch([BatchItem(seq_id, tokens, start, num_logits)])[0]

    def _call_batch(self, items: Sequence[BatchItem], rows: list[tuple]) -> tuple:
        if self._varlen is None:
            return super()._call_batch(items, rows)
        exts = [self._alloc.extent(it.seq_id) for it in items]
        return self._varlen.run([r[0] for r in rows], [it.start for it in items], [r[2] for r in rows],
                                [(e.reserved, e.offset * self._per_pos) for e in exts])

    def _infer_batch(self, feeds: dict) -> list:
        return self._session.run(self._outputs, feeds)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give the empty sequence `dst` the KV of `src`'s first `length` positions.
        Every row here is row-invariant (prefill included: tested), so the copy is
        bitwise the KV dst would compute for the same tokens: a server reuses a
        shared prompt prefix instead of computing it again."""
        if length > self.length(src):
            raise ValueError(f"sequence {src} holds {self.length(src)} positions, not {length}")
        if self.length(dst):
            raise ValueError(f"sequence {dst} is not empty")
        with self._alloc.writing(dst, 0, length):
            self._slabs[dst][:, :, :, :length] = self._slabs[src][:, :, :, :length]


def _forced_key(options: BackendOptions) -> str:
    """The forced padding as the kernel choice's cache key names it ("": none forced,
    the key of every cached choice made without one)."""
    return options.forced_padding or ""
