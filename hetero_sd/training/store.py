"""The target pass on disk: every sequence's tokens, features and final states in flat files.

A million tokens of SmolLM2 features are 3.5 GB (fp16), more than a training
run should hold in memory, so the pass appends to raw files under `folder/`
and training reads windows through memory maps:
  tokens.i32    [rows]         token ids, sequence after sequence
  features.f16  [rows, F]      the target's feature layers at each row
  final.f16     [rows, H]      the target's last state after the final norm (labels = one matmul)
  index.json    {"offsets": [0, end of sequence 1, ...], "F": F, "H": H}
index.json is written after the rows, so a pass stopped mid-sequence resumes
from the last sequence it recorded (the files are cut back to it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

_FILES = (("tokens.i32", np.int32), ("features.f16", np.float16), ("final.f16", np.float16))


class ExampleStore:
    def __init__(self, folder: Path, features: int, hidden: int):
        self.folder, self.F, self.H = Path(folder), features, hidden
        self.folder.mkdir(parents=True, exist_ok=True)
        index = self.folder / "index.json"
        self.offsets = [0]
        if index.exists():
            got = json.loads(index.read_text())
            if (got["F"], got["H"]) == (features, hidden):
                self.offsets = got["offsets"]
        self._cut_back()
        self._maps = None

    def _widths(self) -> tuple[int, ...]:
        return 1, self.F, self.H

    def _cut_back(self) -> None:
        rows = self.offsets[-1]
        for (name, dtype), width in zip(_FILES, self._widths()):
            path = self.folder / name
            with open(path, "ab") as f:
                f.truncate(rows * width * np.dtype(dtype).itemsize)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    def append(self, tokens, features: np.ndarray, final: np.ndarray) -> None:
        n = len(tokens)
        if features.shape != (n, self.F) or final.shape != (n, self.H):
            raise ValueError(f"store: rows {features.shape} / {final.shape} for {n} tokens")
        for (name, dtype), arr in zip(_FILES, (np.asarray(tokens), features, final)):
            with open(self.folder / name, "ab") as f:
                f.write(np.ascontiguousarray(arr, dtype=dtype).tobytes())
        self.offsets.append(self.rows + n)
        tmp = self.folder / "index.json.tmp"
        tmp.write_text(json.dumps({"offsets": self.offsets, "F": self.F, "H": self.H}))
        os.replace(tmp, self.folder / "index.json")
        self._maps = None

    def _open(self):
        if self._maps is None:
            self._maps = [np.memmap(self.folder / name, dtype=dtype, mode="r", shape=(self.rows, w) if w > 1
                                    else (self.rows,))
                          for (name, dtype), w in zip(_FILES, self._widths())]
        return self._maps

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def window(self, i: int, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence i's rows start .. start + length: (tokens, features, final)."""
        a = self.offsets[i] + start
        b = a + length
        if b > self.offsets[i + 1]:
            raise IndexError(f"store: sequence {i} has {self.length(i)} rows, not {start + length}")
        tokens, feats, final = self._open()
        return tokens[a:b].astype(np.int64), np.array(feats[a:b]), np.array(final[a:b])
