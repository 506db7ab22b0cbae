"""The version of the graph the ONNX lowering builds (onnx_llama.py with
onnx_blocks.py and onnx_batch.py): part of every cached graph's key, so bump
it whenever that graph changes. A module of its own, so that loading a
cached graph imports neither onnx nor torch."""

GRAPH_VERSION = 28
