"""Named weight tensors, read lazily from safetensors folders or GGUF files.

A weight source answers `names()` and `get(name)`; names follow Hugging Face
conventions ("model.layers.0.self_attn.q_proj.weight") whatever the file
format, so a model family maps names once. Tensors come back as float32 CPU
torch tensors; a backend casts them to its own precision.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from hetero_sd.ir.errors import ModelLoadError

if TYPE_CHECKING:  # tensors are made on demand; describing a model imports no torch
    import torch


class WeightSource:
    """Named tensors, read on demand. Optional, declared here: `has_blocks` and
    blocks(name) (the file's own quantized blocks: GGUF), release_pages() (drop a
    mapped file's pages once every tensor was read)."""

    has_blocks = False

    def names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def release_pages(self) -> None:
        """Optional: nothing to release for a source that maps nothing."""


class SafetensorsSource(WeightSource):
    """One `model.safetensors` or shards listed in `model.safetensors.index.json`.

    `aliases` maps the family's names to the file's where a checkpoint names a
    tensor otherwise (Mixtral's experts); `fixup(name, tensor)` turns a stored
    weight into the IR's form (Gemma stores its norms as offsets from one)."""

    def __init__(self, folder: Path, aliases: dict[str, str] | None = None,
                 fixup: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        from safetensors import safe_open

        self.folder = folder
        self._fixup = fixup
        ir_name = {stored: name for name, stored in (aliases or {}).items()}
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder}: no *.safetensors files (a Hugging Face folder needs weights)")
        self._handles = {}
        self._where: dict[str, tuple[str, str]] = {}  # IR name -> (file, stored name)
        for fname in files:
            path = folder / fname
            if not path.exists():
                raise ModelLoadError(f"{folder}: shard {fname} named in the index is missing")
            try:
                # The names, read without torch (a lowering served from its cache never needs
                # a tensor); tensors come through a torch handle opened on first use.
                keys = safe_open(str(path), framework="numpy").keys()
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc
            for key in keys:
                self._where[ir_name.get(key, key)] = (fname, key)

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ModelLoadError(f"{self.folder}: tensor {name!r} is missing from the safetensors files")
        import torch

        from safetensors import safe_open

        fname, stored = self._where[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.folder / fname), framework="pt")
        # copy: a float32 tensor would otherwise alias the memory-mapped file
        tensor = self._handles[fname].get_tensor(stored).to(torch.float32, copy=True)
        return self._fixup(name, tensor) if self._fixup is not None else tensor


class GGUFSource(WeightSource):
    """Tensors of a GGUF file under Hugging Face names, dequantized on demand.

    `name_map` maps HF names to GGUF names, or to (GGUF name, i) for slice i
    of a stacked tensor (llama.cpp stores a layer's experts as one
    [experts, rows, cols] tensor); `fixup(hf_name, array)` undoes
    format-specific layouts (llama.cpp permutes Llama Q/K rows for its RoPE).
    """

    has_blocks = True

    def __init__(self, reader, path: Path, name_map: dict[str, str],
                 fixup: Callable[[str, np.ndarray], np.ndarray] | None = None):
        self.path = path
        self._data = getattr(reader, "data", None)  # the file's memory map
        self._tensors = {t.name: t for t in reader.tensors}
        self._map = {hf: (g if isinstance(g, tuple) else (g, None)) for hf, g in name_map.items()
                     if (g[0] if isinstance(g, tuple) else g) in self._tensors}
        self._fixup = fixup

    def names(self) -> list[str]:
        return list(self._map)

    def get(self, name: str) -> torch.Tensor:
        import gguf

        if name not in self._map:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        tensor, data, rows, cols = self._slice(name)
        if rows is None:
            array = gguf.quants.dequantize(data, tensor.tensor_type)
        else:
            array = gguf.quants.dequantize(data.reshape(rows, -1), tensor.tensor_type).reshape(rows, cols)
        array = array.astype(np.float32, copy=False)
        if self._fixup is not None:
            array = self._fixup(name, array)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array, copy=True)  # F32 tensors are read-only views of the mmap
        import torch

        return torch.from_numpy(array)

    def _slice(self, name: str):
        """(tensor, its data or the named slice's, rows, cols); rows None: the whole tensor as stored."""
        gname, index = self._map[name]
        tensor = self._tensors[gname]
        if index is None:
            return tensor, tensor.data, None, None
        dims = [int(d) for d in tensor.shape]  # GGUF lists the fastest axis first: [cols, rows, experts]
        return tensor, np.asarray(tensor.data).reshape(dims[-1], -1)[index], dims[1], dims[0]

    def release_pages(self) -> None:
        """Drop the file pages read so far from this process's resident set
        (they stay in the page cache; a later read maps them back). After a
        lowering has streamed every tensor, the mapped file would otherwise
        count once more on top of the runtime's own copy: 4.7 GB for a 7B."""
        import mmap

        handle = getattr(self._data, "_mmap", None)
        if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                handle.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # a closed map or a platform without it: only memory is at stake
                pass

    def type_name(self, name: str) -> str:
        """The GGUF type the tensor is stored as ("Q4_K", "F32", ...)."""
        return self._tensors[self._map[name][0]].tensor_type.name

    def blocks(self, name: str):
        """The tensor as block-affine integers (ir/quant.py), straight from the
        file's blocks; None where it is stored as floats or as a block type with
        no such form (the caller reads `get` instead)."""
        from hetero_sd.ir import quant

        if name not in self._map:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        tensor, data, rows, cols = self._slice(name)
        if rows is None:
            if len(tensor.shape) != 2:
                return None
            cols, rows = (int(d) for d in tensor.shape)  # GGUF lists the fastest axis first
        if tensor.tensor_type.name not in quant.SUPPORTED:
            return None
        data = np.asarray(data).reshape(rows, -1)  # whole rows: blocks never cross one
        if self._fixup is not None:
            data = self._fixup(name, data)  # a row permutation moves whole rows of blocks
        return quant.decode(tensor.tensor_type.name, data, rows, cols)
