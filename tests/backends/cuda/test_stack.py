"""ops.stack: weights stack into one matmul only when every part has the same layout."""
import torch

from hetero_sd.backends.cuda.ops import Blocks, Dense, stack


def _blocks(n: int, bits: int = 8, group: int = 32, offset: bool = False) -> Blocks:
    return Blocks(torch.zeros(n, 64, dtype=torch.uint8), torch.ones(n, 64 // group), torch.zeros(n, 64 // group)
                  if offset else None, 0.0, group, bits, n, 64, "Q8_0")


def test_stack_joins_like_parts_and_keeps_mixed_ones_apart():
    joined = stack([_blocks(2), _blocks(3)])
    assert isinstance(joined, Blocks) and joined.shape == (5, 64) and joined.q.shape == (5, 64)
    dense = stack([Dense(torch.zeros(2, 64)), Dense(torch.zeros(3, 64))])
    assert isinstance(dense, Dense) and dense.shape == (5, 64)
    for parts in ([Dense(torch.zeros(2, 64)), _blocks(3)], [_blocks(2), _blocks(3, bits=4)],
                  [_blocks(2), _blocks(3, group=16)], [_blocks(2), _blocks(3, offset=True)]):
        assert stack(parts) is parts
