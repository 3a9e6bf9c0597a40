"""Hugging Face checkpoint loading: lazy memory-mapped tensors, and a clear `CheckpointError` or
`ModelError` for every way a checkpoint directory can be wrong."""
from __future__ import annotations

import json
import struct
import tracemalloc

import llama_oracle
import numpy as np
import pytest
from checkpoints import write_checkpoint, write_safetensors

from einpage.errors import CheckpointError, ModelError
from einpage.models import resolve
from einpage.models.checkpoint import Checkpoint, CheckpointWeights, read_safetensors_header

GATE = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", seed=2)


def tensors_of(path):
    """The f32 tensors of a single-file checkpoint, by name (a copy, for rewriting)."""
    return {k: v.astype(np.float32) for k, v in
            llama_oracle.read_safetensors(path / "model.safetensors").items()}


# ------------------------------------------------------------------ lazy loading


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("shards", [1, 3])
def test_arrays_are_memory_mapped_views(tmp_path, dtype, shards):
    path = write_checkpoint(tmp_path, dtype=dtype, shards=shards, seed=1)
    ckpt = Checkpoint(path)
    _, oracle = llama_oracle.load_hf_checkpoint(path)
    assert set(ckpt.tensors) == set(oracle)
    for name, want in oracle.items():
        arr = ckpt.array(name)
        assert isinstance(arr, np.memmap), name
        assert not arr.flags.owndata and not arr.flags.writeable
        assert arr.dtype == {"f32": np.float32, "f16": np.float16}.get(dtype, np.dtype("bfloat16"))
        np.testing.assert_array_equal(arr.astype(np.float64), want, err_msg=name)


def test_opening_reads_headers_only(tmp_path):
    """A 1 GiB tensor (a sparse file) opens, checks and slices without reading its data."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text((write_checkpoint(tmp_path / "small") / "config.json")
                                     .read_text())
    header = json.dumps({"big": {"dtype": "F32", "shape": [2**14, 2**14],
                                 "data_offsets": [0, 2**30]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(big / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + 2**30)
    tracemalloc.start()
    try:
        ckpt = Checkpoint(big)
        arr = ckpt.array("big")
        corner = np.array(arr[:2, :3])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert arr.shape == (2**14, 2**14) and isinstance(arr, np.memmap)
    np.testing.assert_array_equal(corner, np.zeros((2, 3), np.float32))
    assert peak < 2**20, f"opening a 1 GiB tensor allocated {peak} bytes"


def test_reads_files_written_by_the_safetensors_library(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float16),
               "b": rng.standard_normal((7,)).astype(np.float32)}
    st.save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "np"})
    refs = read_safetensors_header(tmp_path / "x.safetensors")
    assert {k: (r.dtype.value, r.shape) for k, r in refs.items()} == {
        "a": ("f16", (3, 5)), "b": ("f32", (7,))}
    raw = np.memmap(tmp_path / "x.safetensors", dtype=np.uint8, mode="r")
    for name, want in tensors.items():
        ref = refs[name]
        got = raw[ref.offset: ref.offset + want.nbytes].view(want.dtype).reshape(want.shape)
        np.testing.assert_array_equal(got, want)


def test_weights_map_graph_names_to_hf_tensors(ckpt):
    weights = CheckpointWeights(Checkpoint(ckpt))
    weights.check()
    wq = weights("layers.1.wq")
    assert wq.shape == (2, 2, 2, 4, 32)  # (kv heads, group, rotary half, j, hidden)
    hf = Checkpoint(ckpt).array("model.layers.1.self_attn.q_proj.weight")
    np.testing.assert_array_equal(wq.reshape(32, 32), hf)
    wo = weights("layers.0.wo")
    assert wo.shape == (32, 2, 2, 2, 4)


def test_tied_checkpoint_needs_no_lm_head(tmp_path):
    from einpage.ir.graph import Einsum
    from einpage.models import llama

    ckpt = Checkpoint(write_checkpoint(tmp_path, tied=True))
    assert "lm_head.weight" not in ckpt.tensors
    CheckpointWeights(ckpt).check()
    graph = llama.prefill_graph(ckpt.config)
    embed = graph.input("embed")
    head = [n for n in graph.nodes if isinstance(n.op, Einsum) and str(n.op.spec) == "bsm,vm->bsv"]
    assert len(head) == 1 and head[0].inputs[1] == embed.id
    assert not any(n.op.name == "lm_head" for n in graph.inputs)


# ------------------------------------------------------------------ errors


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="absent: no such checkpoint directory"):
        Checkpoint(tmp_path / "absent")


def test_no_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="ckpt: no config.json"):
        Checkpoint(ckpt)


@pytest.mark.parametrize("change, error, message", [
    (lambda c: c.update(model_type="gpt2"), ModelError,
     "model_type 'gpt2' is not supported \\(einpage runs llama, mistral, qwen2, qwen3, "
     "mixtral\\)"),
    (lambda c: c.pop("model_type"), ModelError, "model_type None is not supported"),
    (lambda c: c.pop("hidden_size"), CheckpointError, "missing key 'hidden_size'"),
    (lambda c: c.update(num_hidden_layers="two"), CheckpointError, "bad value"),
    (lambda c: c.update(torch_dtype="int8"), CheckpointError, "bad value: unknown dtype 'int8'"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ModelError,
     "rope_type 'dynamic' \\(einpage runs default, linear, llama3\\) is not supported"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), ModelError,
     "rope_type 'yarn' .* is not supported"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     CheckpointError, "missing key 'original_max_position_embeddings'"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": -1}),
     CheckpointError, "factor must be a positive number"),
    (lambda c: c.update(hidden_act="gelu"), ModelError, "hidden_act 'gelu' is not supported"),
    (lambda c: c.update(mlp_bias=True), ModelError, "mlp_bias is not supported"),
    (lambda c: c.update(num_hidden_layers=-2), CheckpointError, "num_hidden_layers must be"),
    (lambda c: c.update(num_attention_heads=True), CheckpointError, "must be a non-negative"),
    (lambda c: c.update(rms_norm_eps="x"), CheckpointError, "rms_norm_eps must be a positive"),
    (lambda c: c.update(model_type="mistral", sliding_window=0), ModelError,
     "sliding_window must be at least 1"),
    (lambda c: c.update(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                        layer_types=["full_attention", "chunked_attention"]), ModelError,
     "layer type 'chunked_attention' is not supported"),
    (lambda c: c.update(model_type="mixtral", num_local_experts=4, num_experts_per_tok=5),
     ModelError, "5 experts per token of 4"),
    (lambda c: c.update(tie_word_embeddings="yes"), CheckpointError, "must be true or false"),
])
def test_bad_config(ckpt, change, error, message):
    config = json.loads((ckpt / "config.json").read_text())
    change(config)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=message):
        Checkpoint(ckpt)


def test_unparsable_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: cannot parse"):
        Checkpoint(ckpt)


def test_missing_tensor(ckpt):
    tensors = tensors_of(ckpt)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(ckpt / "model.safetensors", tensors)
    ckpt_obj = Checkpoint(ckpt)  # opening does not need every tensor
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        CheckpointWeights(ckpt_obj).check()
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        resolve(str(ckpt))


def test_misshaped_tensor(ckpt):
    tensors = tensors_of(ckpt)
    tensors[GATE] = np.ascontiguousarray(tensors[GATE].T)
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as err:
        resolve(str(ckpt))
    assert str(err.value) == (f"{ckpt}: tensor '{GATE}' has shape (32, 48), expected (48, 32)")


def test_untied_checkpoint_without_lm_head(ckpt):
    tensors = tensors_of(ckpt)
    del tensors["lm_head.weight"]
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        resolve(str(ckpt))


@pytest.mark.parametrize("cut", [1, 100])
def test_truncated_file(ckpt, cut):
    path = ckpt / "model.safetensors"
    last = sorted(tensors_of(ckpt))[-1]  # the writer stores tensors sorted by name
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(CheckpointError, match=f"tensor '{last}': data range .* does not match "
                                              "shape .* or the file size"):
        Checkpoint(ckpt)


@pytest.mark.parametrize("content, message", [
    (b"", "not a safetensors file \\(shorter than 8 bytes\\)"),
    (b"\x01\x02\x03", "not a safetensors file"),
    (struct.pack("<Q", 10**6) + b"{}", "header length 1000000 exceeds the file"),
    (struct.pack("<Q", 4) + b"{bad", "cannot read safetensors header"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "cannot read safetensors header"),
])
def test_corrupt_header(tmp_path, content, message):
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        read_safetensors_header(tmp_path / "x.safetensors")


@pytest.mark.parametrize("entry", [
    {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]},
    {"dtype": "F32", "shape": [2]},
    {"dtype": "F32", "shape": "two", "data_offsets": [0, 8]},
])
def test_unsupported_header_entry(tmp_path, entry):
    header = json.dumps({"w": entry}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="tensor 'w': unsupported or malformed entry"):
        read_safetensors_header(tmp_path / "x.safetensors")


def test_index_lists_a_missing_shard(tmp_path):
    path = write_checkpoint(tmp_path / "sharded", shards=3)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: listed in the "
                                              "index but missing"):
        Checkpoint(path)


def test_malformed_index(tmp_path):
    path = write_checkpoint(tmp_path / "sharded", shards=2)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="malformed index"):
        Checkpoint(path)


def test_no_safetensors_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        Checkpoint(ckpt)


def _safetensors_files():
    from conftest import FIXTURES
    return sorted(FIXTURES.glob("*/*.safetensors")) if FIXTURES.is_dir() else []


@pytest.mark.parametrize("path", _safetensors_files(), ids=lambda p: p.parent.name)
def test_our_header_reader_agrees_with_the_safetensors_library(path):
    """Every tensor of every Hugging Face fixture: the same names, shapes, dtypes and bytes
    through einpage's memory-mapped reader as through `safetensors.safe_open`."""
    from safetensors import safe_open

    from einpage.models.checkpoint import tensor_view
    refs = read_safetensors_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(refs)
        for name in f.keys():
            theirs, ours = f.get_tensor(name), tensor_view(refs[name], mapped)
            assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), name
            assert ours.tobytes() == theirs.tobytes(), name


def test_the_safetensors_reader_agrees_on_every_dtype_the_tests_write(tmp_path):
    from safetensors.numpy import load_file

    from einpage.models.checkpoint import tensor_view
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "b": np.ones(5, np.float32)}
    for dtype in ("f32", "f16", "bf16"):
        path = tmp_path / f"{dtype}.safetensors"
        write_safetensors(path, tensors, dtype)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        theirs = load_file(str(path))
        for name, ref in read_safetensors_header(path).items():
            assert tensor_view(ref, mapped).tobytes() == theirs[name].tobytes()
