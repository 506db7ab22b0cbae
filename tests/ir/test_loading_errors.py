"""Loading errors: a missing, broken or unsupported model (HF folder or GGUF file)
is a ModelLoadError naming what is wrong. Config parsing, lazy weights and
tokenizers: test_loading.py."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers import tiny_models as tm
from hetero_sd.errors import HeteroSDError, ModelLoadError
from hetero_sd.ir import load_model_ir, reference_logits


# ------------------------------------------------------------------------ errors
def _copy(folder, dst):
    shutil.copytree(folder, dst)
    return dst


def _load_everything(path):
    """Load the IR and touch every weight (an error may surface at load time or at first use)."""
    ir = load_model_ir(path)
    reference_logits(ir, [tm.BOS_ID, 10, 11])
    return ir


def test_error_types():
    assert issubclass(ModelLoadError, HeteroSDError)


def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(missing)
    msg = str(err.value)
    assert "no-such-model" in msg and "exist" in msg.lower()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="nothere.gguf"):
        load_model_ir(tmp_path / "nothere.gguf")


def test_folder_without_config(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "noconfig")
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_ir(folder)


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_ir(tmp_path / "empty")


def test_folder_without_weights(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        _load_everything(folder)


def test_invalid_config_json(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "badjson")
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_ir(folder)


def test_unsupported_model_type(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "neox")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(folder)
    msg = str(err.value)
    assert "gpt_neox" in msg
    assert "llama" in msg  # names what is supported


def test_unsupported_rope_type(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama-rope-linear"), tmp_path / "yarn")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                              "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model_ir(folder)


def test_removed_tensor(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = _copy(tiny_model_dir("llama"), tmp_path / "removed")
    weights = load_file(str(folder / "model.safetensors"))
    gone = "model.layers.1.mlp.down_proj.weight"
    del weights[gone]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=gone.replace(".", r"\.")):
        _load_everything(folder)
    ir = load_model_ir(folder)  # the names that are present still load
    with pytest.raises(ModelLoadError, match=gone.replace(".", r"\.")):
        ir.weights.get(gone)


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "truncated")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        _load_everything(folder)


def test_missing_shard(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama", shards=3), tmp_path / "shardless")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (folder / victim).unlink()
    with pytest.raises(ModelLoadError, match=victim.replace(".", r"\.")):
        _load_everything(folder)


def test_gguf_missing_tensor(tiny_model_dir, tmp_path):
    path = tm.make_gguf(tiny_model_dir("llama"), tmp_path / "drop" / "drop.gguf", "F32",
                        drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight|blk\.1\.ffn_down"):
        _load_everything(path)


def test_gguf_unsupported_architecture(tiny_model_dir, tmp_path):
    path = tm.make_gguf(tiny_model_dir("llama"), tmp_path / "falcon" / "falcon.gguf", "F32", arch="falcon")
    with pytest.raises(ModelLoadError) as err:
        load_model_ir(path)
    assert "falcon" in str(err.value)
    for known in ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "smollm3"):
        assert known in str(err.value)


def test_truncated_gguf(tiny_gguf, tmp_path):
    data = tiny_gguf("llama", "F32").read_bytes()
    path = tmp_path / "cut" / "cut.gguf"
    path.parent.mkdir()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        _load_everything(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_model_ir(path)


def test_unknown_file_kind(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="model.bin"):
        load_model_ir(path)


def test_tokenizer_missing_raises_model_load_error(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama"), tmp_path / "notok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink()
    ir = load_model_ir(folder)  # weights and config are fine
    with pytest.raises(ModelLoadError, match="tokenizer"):
        ir.load_tokenizer()
