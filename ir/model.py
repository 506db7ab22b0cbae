"""The model IR: hyper-parameters, lazily loaded named weights, tokenizer source.

`load_model_ir(path)` accepts a Hugging Face folder (config.json,
*.safetensors, tokenizer files) or a GGUF file. Nothing heavy happens here:
weights stay on disk until a backend asks for them.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from hetero_sd.ir import families
from hetero_sd.ir.cache import cache_dir, cached
from hetero_sd.ir.config import ModelConfig
from hetero_sd.ir.errors import ModelLoadError
from hetero_sd.ir.weights import GGUFSource, SafetensorsSource, WeightSource

if TYPE_CHECKING:  # torch is imported where tensors are made, not by reading a model's description
    import torch


@dataclass
class ModelIR:
    config: ModelConfig
    weights: WeightSource
    source: Path  # the folder or .gguf file it came from
    fmt: str  # "hf" | "gguf"

    def with_output_vocab(self, n: int | None) -> "ModelIR":
        """The same model with its LM head restricted to token ids < n: inputs
        still take any id; outputs score the first n. BPE vocabularies list
        their most frequent merges first, so a draft keeps most of its
        acceptance at a fraction of a 150k-row head's cost."""
        if n is None:
            return self
        if not 1 <= n <= self.config.vocab_size:
            raise ModelLoadError(f"{self.source}: an output vocabulary of {n} is outside 1..{self.config.vocab_size}")
        return dataclasses.replace(self, config=dataclasses.replace(self.config, output_vocab=n))

    def with_features(self, layers: tuple[int, ...] | None) -> "ModelIR":
        """The same model whose forward also returns, for every input row, the
        hidden states of decoder `layers` (index i: the output of layer i,
        0-based, before the final norm), concatenated in the given order; a
        runner of it offers `take_features` (backends/base.py). None: unchanged."""
        if layers is None:
            return self
        n = self.config.num_layers
        try:
            layers = tuple(operator.index(i) for i in layers)
        except TypeError:
            raise ModelLoadError(f"{self.source}: feature layers must be integers, got {layers!r}") from None
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ModelLoadError(f"{self.source}: feature layer(s) {bad} outside 0..{n - 1} "
                                 f"(the model has {n} decoder layers)")
        return dataclasses.replace(self, config=dataclasses.replace(self.config, feature_layers=layers))

    @property
    def family(self):
        return families.family(self.config.family)

    def weight_names(self) -> list[str]:
        return self.family.weight_names(self.config)

    def check_weights(self) -> list[str]:
        """The weight names the family needs; an error if the file lacks any."""
        names = self.weight_names()
        available = set(self.weights.names())
        missing = [n for n in names if n not in available]
        if missing:
            raise ModelLoadError(f"{self.source}: {len(missing)} required tensor(s) missing, "
                                 f"first {missing[0]!r}")
        return names

    def iter_weights(self, progress: Callable[[int, int, str], None] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight the family needs, in order, checking none is missing."""
        names = self.check_weights()
        for i, name in enumerate(names):
            if progress is not None:
                progress(i, len(names), name)
            yield name, self.weights.get(name)

    def load_tokenizer(self, progress: Callable[[int, int, str], None] | None = None):
        """The tokenizer (with its chat template). From a GGUF, transformers builds it by
        parsing the whole file (seconds to minutes by model size), so the result is saved
        once to the cache and read from there; `progress(0, 0, what)` is told when that
        build starts. A saved fast tokenizer is read without transformers (ir/tokenizer.py)."""
        from importlib.metadata import version

        from hetero_sd.ir import tokenizer as light

        try:
            if self.fmt == "gguf":
                def build(path: Path) -> None:
                    from transformers import AutoTokenizer

                    if progress is not None:
                        progress(0, 0, "building the tokenizer from the GGUF (once; cached)")
                    tok = AutoTokenizer.from_pretrained(str(self.source.parent), gguf_file=self.source.name)
                    tok.save_pretrained(str(path))

                folder = cached(cache_dir("tokenizer", self.source, transformers=version("transformers")),
                                "tokenizer", build)
            else:
                folder = self.source
            tok = light.load(folder)
            if tok is None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(folder))
            return tok
        except Exception as exc:  # transformers and tokenizers raise many types here
            raise ModelLoadError(f"{self.source}: cannot build a tokenizer ({exc})") from exc


def load_model_ir(path: str | Path) -> ModelIR:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return _load_hf(path)
    if path.suffix == ".gguf" or _gguf_magic(path):  # (a hub cache's blob has no .gguf ending)
        return _load_gguf(path)
    raise ModelLoadError(f"{path}: expected a Hugging Face model folder or a .gguf file")


def _gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _load_hf(folder: Path) -> ModelIR:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg_path}: invalid JSON ({exc})") from exc
    try:
        fam = families.family_for_hf(hf.get("model_type", "<missing model_type>"))
        cfg = fam.config_from_hf(hf)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{cfg_path}: {exc}") from None
    return ModelIR(cfg, SafetensorsSource(folder, fam.hf_aliases(cfg), fam.hf_fixup(cfg)), folder, "hf")


@functools.cache
def _fast_reader():
    """gguf.GGUFReader that reads an array field as one block. The stock reader
    makes one or two numpy views per element, which took ~6 s for SmolLM2's
    49k-entry vocabulary and merges; here string arrays are stepped over (their
    text is never read: transformers builds the tokenizer, once, cached) and
    numeric arrays are one view. An array field's parts are [type, count, block]."""
    import struct

    import gguf
    import numpy as np
    from gguf.constants import GGUFValueType

    class FastReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or getattr(self, "byte_order", "I") != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            sub, n, offs = GGUFValueType(int(itype[0])), int(count[0]), orig_offs + 12
            if sub == GGUFValueType.STRING:
                view = memoryview(self.data)
                for _ in range(n):
                    offs += 8 + struct.unpack_from("=Q", view, offs)[0]  # the file's order is the host's
                return offs - orig_offs, [itype, count, self._get(orig_offs + 12, np.uint8, offs - orig_offs - 12)], \
                    [], [GGUFValueType.ARRAY, sub]
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is None:  # nested arrays: the stock path
                return super()._get_field_parts(orig_offs, raw_type)
            block = self._get(offs, nptype, n)
            return 12 + int(block.nbytes), [itype, count, block], [2], [GGUFValueType.ARRAY, sub]

    return FastReader


def _load_gguf(path: Path) -> ModelIR:
    import gguf
    from gguf.constants import GGUFValueType

    try:
        reader = _fast_reader()(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    fields = {}
    for key, field in reader.fields.items():
        if field.types[:1] == [GGUFValueType.ARRAY] and field.types[-1] == GGUFValueType.STRING:
            fields[key] = range(int(field.parts[4][0]))  # [key len, key, type, item type, count, ...]: a size
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # exotic field types we never read
            continue
    arch = fields.get("general.architecture", "<missing general.architecture>")
    try:
        fam = families.family_for_gguf(arch)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    def vector(name: str) -> tuple[float, ...] | None:
        """A small tensor (RoPE factors) as floats; None if the file has none."""
        return next((tuple(float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).ravel())
                     for t in reader.tensors if t.name == name), None)

    try:
        cfg = fam.config_from_gguf(fields, arch, {t.name for t in reader.tensors}, vector)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    fam = families.family(cfg.family)  # one GGUF architecture may hold several families (llama: Mixtral)
    source = GGUFSource(reader, path, fam.gguf_name_map(cfg), fam.gguf_fixup(cfg, arch))
    return ModelIR(cfg, source, path, "gguf")


def reference_logits(model: ModelIR, token_ids: list[int], dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """Logits [T, vocab] of the reference forward on a fresh cache (for tests and tools); float32 by default."""
    import torch

    dtype = dtype or torch.float32
    cfg = model.config
    weights = {n: t.to(dtype) for n, t in model.iter_weights()}
    forward = model.family.Forward(cfg, weights, dtype)
    n = len(token_ids)
    shape = (cfg.num_layers, cfg.num_kv_heads, n, cfg.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    with torch.inference_mode():
        return forward(torch.tensor(token_ids, dtype=torch.long), 0, k_cache, v_cache, num_logits=n)
