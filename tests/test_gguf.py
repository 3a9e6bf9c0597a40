"""GGUF files as einpage models (`einpage.models.gguf`): config, weights (dense, packed, the
q/k permutation undone), tokenizer and every refusal, against the Hugging Face fixtures the
files are written from (`tests/gguf_files.py`, laid out as llama.cpp's converter lays them out),
and, where they exist, against the files llama.cpp itself made (tests/fixtures/gguf/)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from einpage.errors import CheckpointError, ModelError
from einpage.ir.dtypes import DType
from einpage.models.checkpoint import Checkpoint, CheckpointWeights
from einpage.models.config import RopeScaling
from einpage.models.gguf import GGUFModel, is_gguf, llama3_factors, llama3_scaling, read_gguf
from einpage.models.text import TextCodec, end_of_sequence
from einpage.ir.quant import dequantize, quantize
from gguf_files import gguf_spec, write_gguf

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = ["tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral", "tiny-qwen2",
            "tiny-qwen3", "tiny-mixtral"]
TOKENIZED = ["tiny-llama31", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral"]
TEXTS = ["Hello world, this is a test.", "héllo wörld — naïve café, 日本語 🙂!",
         "  two  spaces\n\nnew\tline 12345 it's I'M", "<s> a special token in text", ""]
#: a graph weight is a matrix (quantized in a quantized file) but for these
_DENSE_SHORT = ("attn_norm", "ffn_norm", "norm", "q_norm", "k_norm", "bq", "bk", "bv", "bo",
                "router")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """`gguf_file(family, ttype)`: the GGUF file of a fixture (written once per module)."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def make(family: str, ttype: str = "f32") -> Path:
        if (family, ttype) not in made:
            made[family, ttype] = write_gguf(FIXTURES / family, root / f"{family}-{ttype}.gguf",
                                             ttype)
        return made[family, ttype]
    return make


def _hf(family: str):
    checkpoint = Checkpoint(FIXTURES / family)
    return checkpoint.config, CheckpointWeights(checkpoint)


def _fields(cfg, skip=("name", "dtype")) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}


# ------------------------------------------------------------------ the header

@pytest.mark.parametrize("family, ttype", [("tiny-llama31", "q8_0"), ("tiny-mixtral", "q4_1"),
                                           ("tiny-qwen2", "f16"), ("tiny-llama-bf16", "bf16")])
def test_header_parser_agrees_with_the_gguf_packages_reader(family, ttype, gguf_file):
    from gguf import GGUFReader
    path = gguf_file(family, ttype)
    metadata, tensors, data = read_gguf(path)
    reader = GGUFReader(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert set(metadata) == set(fields)
    for key, field in fields.items():
        want = field.contents()
        if field.types[0] == V.FLOAT32:
            assert metadata[key] == pytest.approx(want, rel=1e-7), key
        elif isinstance(metadata[key], np.ndarray):
            np.testing.assert_array_equal(metadata[key], want, err_msg=key)
        else:
            assert metadata[key] == want, key
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = tensors[t.name]
        shape = tuple(int(d) for d in t.shape[::-1])
        assert (mine.type, mine.shape) == (t.tensor_type.name, shape)
        assert (mine.offset, mine.nbytes) == (t.data_offset, t.n_bytes)
        raw = t.data.reshape(-1).view(np.uint8)
        assert np.array_equal(data[mine.offset:mine.offset + mine.nbytes], raw)


def test_header_refusals(tmp_path):
    for name, blob, match in [
            ("v1", b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "version 1 is not supported"),
            ("big-endian", b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "a big-endian GGUF file"),
            ("huge-count", b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
             + (10 ** 12).to_bytes(8, "little"), "malformed GGUF header .1000000000000 items"),
            ("bad-type", b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
             + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"k"
             + (77).to_bytes(4, "little"), "malformed GGUF header .value type 77"),
            ("cut", b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little"),
             "truncated GGUF file .it ends inside the header, at byte 16")]:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(blob)
        with pytest.raises(CheckpointError, match=match) as exc:
            GGUFModel(path)
        _one_line(exc, path)


# ------------------------------------------------------------------ config

@pytest.mark.parametrize("family", FAMILIES)
def test_config_equals_the_hf_fixture(family, gguf_file):
    cfg, _ = _hf(family)
    got = GGUFModel(gguf_file(family)).config
    if family == "tiny-mistral":
        # arch llama: llama.cpp's converter writes no sliding window, and llama.cpp runs none
        assert (got.family, got.sliding_window) == ("llama", None)
        cfg = dataclasses.replace(cfg, family="llama", sliding_window=None)
    assert _fields(got) == _fields(cfg)
    assert got.name == f"{family}-f32" and got.dtype is DType.f16


def test_dtype_argument_and_the_llama3_rope_of_the_file(gguf_file):
    assert GGUFModel(gguf_file("tiny-llama31"), dtype="f32").config.dtype is DType.f32
    model = GGUFModel(gguf_file("tiny-llama31"), dtype=DType.bf16)
    assert model.config.dtype is DType.bf16
    rope = model.config.rope_scaling
    assert rope == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    t = model.tensors["rope_freqs.weight"]
    factors = model.data[t.offset:t.offset + t.nbytes].view(np.float32)
    np.testing.assert_allclose(llama3_factors(rope, 500000.0, 16), factors, rtol=1e-6)


@pytest.mark.parametrize("rope, head_dim", [
    (RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 128),     # Llama 3.1: many interpolated
    (RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), 64),     # Llama 3.2
    (RopeScaling("llama3", 8.0, 1.0, 4.0, 16), 16),        # one interpolated factor
    (RopeScaling("llama3", 8.0, 2.0, 16.0, 4096), 128),    # other bounds
])
def test_llama3_scaling_is_recovered_from_its_factors(rope, head_dim):
    """Only the wavelength bounds (context / low, context / high) are in the factors: the
    context comes from `rope.scaling.original_context_length` where the file has it, else it is
    the low bound (low_freq_factor 1), which is the same scaling."""
    factors = llama3_factors(rope, 500000.0, head_dim).astype(np.float32)
    assert llama3_scaling(factors, 500000.0, head_dim, original=rope.original_context) == rope
    found = llama3_scaling(factors, 500000.0, head_dim)
    bound = rope.original_context / rope.low_freq_factor  # the low wavelength bound
    assert found.original_context / found.low_freq_factor == bound
    np.testing.assert_allclose(llama3_factors(found, 500000.0, head_dim), factors, rtol=1e-6)
    if rope.low_freq_factor == 1.0:
        assert found == rope


def test_llama3_scaling_without_interpolated_factors_and_refusals():
    factors = np.array([1, 1, 1, 8, 8, 8, 8, 8], np.float32)
    rope = llama3_scaling(factors, 500000.0, 16)
    np.testing.assert_array_equal(llama3_factors(rope, 500000.0, 16), factors)
    assert llama3_scaling(np.ones(8, np.float32), 500000.0, 16) is None
    for bad in ([1, 8, 1, 8, 1, 8, 1, 8], [0.5] * 8, [1, 2, 3, 4, 5, 6, 7, 8.0]):
        with pytest.raises(ModelError, match="rope_freqs"):
            llama3_scaling(np.array(bad, np.float32), 500000.0, 16)


def test_linear_rope_scaling_and_a_sliding_window_key(tmp_path):
    spec = gguf_spec(FIXTURES / "tiny-llama-f32")
    spec.set("llama.rope.scaling.type", "linear")
    spec.set("llama.rope.scaling.factor", 2.0)
    spec.set("llama.attention.sliding_window", 7)
    cfg = GGUFModel(spec.write(tmp_path / "linear.gguf")).config
    assert (cfg.rope_scaling, cfg.sliding_window) == (RopeScaling("linear", 2.0), 7)


# ------------------------------------------------------------------ weights

@pytest.mark.parametrize("family, ttype", [(f, "f32") for f in FAMILIES]
                         + [("tiny-llama-f32", "f16"), ("tiny-llama-bf16", "bf16"),
                            ("tiny-mixtral", "f16"), ("tiny-qwen3", "f16")])
def test_dense_weights_equal_the_hf_checkpoint(family, ttype, gguf_file):
    model = GGUFModel(gguf_file(family, ttype))
    _, hf = _hf(family)
    model.weights.check()
    assert model.storages() == {}
    for name, slot in model.slots.items():
        got = model.weights(name)
        assert got.shape == slot.shape and model.weights.storage(name) is None, name
        want = np.asarray(hf(name))
        dense = ttype == "f32" or name.rsplit(".", 1)[-1] in _DENSE_SHORT
        assert got.dtype == (np.float32 if dense else want.dtype if ttype == "bf16"
                             else np.float16), name
        assert np.array_equal(got, want.astype(got.dtype)), name
        assert np.shares_memory(got, model.data), name  # a view of the memory map


@pytest.mark.parametrize("ttype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_weights_are_the_packed_hf_weights(family, ttype, gguf_file):
    """Packed bytes equal einpage's `quantize` of the HF weight (the file was quantized by the
    gguf package after llama.cpp's permutation: the rows are exact); they dequantize to within
    the format's step; a matrix whose rows are not whole groups is F16, as the converter
    leaves it, and the output matrix of a Q4 file Q8_0, as llama-quantize leaves it."""
    model = GGUFModel(gguf_file(family, ttype))
    _, hf = _hf(family)
    model.weights.check()
    storages = model.storages()
    for name, slot in model.slots.items():
        got, want = model.weights(name), np.asarray(hf(name)).astype(np.float32)
        storage = storages.get(name)
        assert storage == model.weights.storage(name)
        assert np.shares_memory(got, model.data), name
        matrix = name.rsplit(".", 1)[-1] not in _DENSE_SHORT
        row = slot.file_shape[-1]
        if not matrix or row % 32:
            assert storage is None, name
            assert got.dtype == (np.float16 if matrix else np.float32), name
            assert np.array_equal(got, want.astype(got.dtype)), name
            continue
        output = "lm_head" if "lm_head" in model.slots else "embed"  # llama-quantize's rule
        fmt = "q8_0" if name == output and ttype in ("q4_0", "q4_1") else ttype
        assert storage is not None and storage.format == fmt, name
        assert got.dtype == np.uint8 and got.shape == storage.packed_shape(slot.shape), name
        assert np.array_equal(got, quantize(want, storage)), name
        back = dequantize(got, storage, slot.shape, np.float32)
        groups, err = want.reshape(-1, 32), np.abs(back - want).reshape(-1, 32).max(axis=1)
        step = {"q8_0": np.abs(groups).max(axis=1) / 127,
                "q4_0": np.abs(groups).max(axis=1) / 8,
                "q4_1": (groups.max(axis=1) - groups.min(axis=1)) / 15}[fmt]
        assert np.all(err <= step * 1.01 + 1e-7), name
    assert len(storages) > 0


def test_llama_q_and_k_biases_are_unpermuted_too(tmp_path):
    """Arch llama with attention biases (`attention_bias`): the converter permutes the q/k
    biases as it permutes the weights. Here: tiny-qwen2's tensors written as arch llama."""
    from gguf_files import permute
    spec = gguf_spec(FIXTURES / "tiny-qwen2")
    spec.arch = "llama"
    spec.meta = {k.replace("qwen2.", "llama.", 1): v for k, v in spec.meta.items()
                 if k != "general.architecture"}
    for name, (values, qtype) in list(spec.tensors.items()):
        part = name.split(".")[-2]
        if part in ("attn_q", "attn_k"):
            heads = 4 if part == "attn_q" else 2
            spec.tensors[name] = (permute(values, heads), qtype)
    model = GGUFModel(spec.write(tmp_path / "biased.gguf"))
    cfg, hf = _hf("tiny-qwen2")
    assert _fields(model.config, ("name", "dtype", "family")) == _fields(
        cfg, ("name", "dtype", "family"))
    assert model.config.qkv_bias and not model.config.o_bias
    for name in model.slots:
        assert np.array_equal(model.weights(name), np.asarray(hf(name))), name


def test_permuted_weights_are_strided_views_and_locate(gguf_file):
    model = GGUFModel(gguf_file("tiny-llama31", "q8_0"))
    wq = model.weights("layers.0.wq")
    assert not wq.flags.c_contiguous and np.shares_memory(wq, model.data)
    assert model.weights.locate("layers.0.wq") is None  # packed
    dense = GGUFModel(gguf_file("tiny-mixtral"))
    assert dense.weights.locate("layers.0.wk") is None  # permuted: read through the map
    where = dense.weights.locate("layers.1.experts.2.w_down")
    t = dense.tensors["blk.1.ffn_down_exps.weight"]
    assert where.offset == t.offset + 2 * 64 * 96 * 4 and where.shape == (64, 96)
    raw = np.memmap(where.path, np.float32, "r", where.offset, where.shape)
    assert np.array_equal(raw, dense.weights("layers.1.experts.2.w_down"))


# ------------------------------------------------------------------ tokenizer

@pytest.mark.parametrize("family", TOKENIZED)
def test_codec_equals_the_hf_tokenizer(family, gguf_file):
    model = GGUFModel(gguf_file(family))
    codec, hf = model.codec(), TextCodec.from_checkpoint(FIXTURES / family)
    assert (codec.bos_id, codec.eos_id, codec.pad_id) == (hf.bos_id, hf.eos_id, hf.pad_id)
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids == hf.encode(text), text
        assert codec.decode(ids) == hf.decode(ids), text
    eos, want = model.end_of_sequence(), end_of_sequence(FIXTURES / family)
    assert (eos.ids, eos.pad_id) == (want.ids, want.pad_id)


#: the pre-tokenizers of Llama 3's and Qwen2's own tokenizer.json (the reference)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str, trim_offsets: bool) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": trim_offsets,
         "use_regex": False}]}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizers_equal_the_models_own(pre, tmp_path):
    from tokenizers import Tokenizer
    src = FIXTURES / "tiny-llama31"
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = (_split_then_bytes(_LLAMA3_REGEX, True) if pre == "llama-bpe"
                             else _split_then_bytes(_QWEN2_REGEX, False))
    if pre == "llama-bpe":
        spec["model"]["ignore_merges"] = True
    else:
        spec["normalizer"] = {"type": "NFC"}
    reference = Tokenizer.from_str(json.dumps(spec))
    codec = GGUFModel(write_gguf(src, tmp_path / "t.gguf", pre=pre)).codec()
    plain = GGUFModel(write_gguf(src, tmp_path / "g.gguf")).codec()
    texts = TEXTS + ["I'M 1234567 \r\n\n  x's", "e\u0301 vs \u00e9"]
    for text in texts:
        assert codec.encode(text) == [0] + reference.encode(text, add_special_tokens=False).ids
    # the fixture's vocabulary has two merges only, so the ids rarely show the split: compare
    # the pieces too (and they differ from GPT-2's)
    pieces = [[p for p, _ in tok._tok.pre_tokenizer.pre_tokenize_str(t)] for tok in
              (codec, plain) for t in texts]
    want = [[p for p, _ in reference.pre_tokenizer.pre_tokenize_str(t)] for t in texts]
    assert pieces[:len(texts)] == want and pieces[len(texts):] != want


def _spm_vocab():
    """A small SentencePiece-style vocabulary: <unk>, <s>, </s>, 256 byte tokens, characters
    and merged pieces (distinct scores: the earlier merged piece is merged first)."""
    tokens, types, scores = ["<unk>", "<s>", "</s>"], [2, 3, 3], [0.0, 0.0, 0.0]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    merged = ["▁t", "he", "▁the", "ll", "llo", "▁he", "▁hello", "or", "▁w", "▁wor", "ld",
              "▁world", "at", "▁c", "▁cat", "lo", "▁h", "el"]
    chars = sorted(set("▁helowrdtcaé!,."))
    tokens += merged + chars
    types += [1] * (len(merged) + len(chars))
    scores += [-float(i) for i in range(len(merged))] + [-100.0 - i for i in range(len(chars))]
    return tokens, types, scores


def _spm_reference(text, tokens, types, scores):
    """llama.cpp's SentencePiece tokenizer: spaces to U+2581 (one prepended), then the adjacent
    pair whose concatenation is the best-scored piece (leftmost of equals) merged until none
    is; a symbol that is no piece becomes its UTF-8 byte tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    symbols = list("▁" + text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            tid = vocab.get(symbols[i] + symbols[i + 1])
            if tid is not None and types[tid] == 1 and (best is None or scores[tid] > best[0]):
                best = (scores[tid], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    ids = []
    for s in symbols:
        ids += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return ids


def test_sentencepiece_tokenizer(tmp_path):
    tokens, types, scores = _spm_vocab()
    spec = gguf_spec(FIXTURES / "tiny-llama-f32")
    spec.set("tokenizer.ggml.model", "llama")
    spec.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    spec.set("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
    spec.set("tokenizer.ggml.scores", scores, V.ARRAY, V.FLOAT32)
    for key, value in (("bos", 1), ("eos", 2), ("unknown", 0)):
        spec.set(f"tokenizer.ggml.{key}_token_id", value)
    codec = GGUFModel(spec.write(tmp_path / "spm.gguf")).codec()
    for text in ["hello world", "the cat", " hello  the world!", "héllo wörld 日本, x.",
                 "hellohello", "lo"]:
        ids = _spm_reference(text, tokens, types, scores)
        assert codec.encode(text) == [1] + ids, text
        assert codec.decode(ids) == text, text
    assert codec.decode([1] + _spm_reference("the cat", tokens, types, scores)) == "<s> the cat"


# ------------------------------------------------------------------ refusals

def _one_line(exc_info, path) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


def test_not_gguf_missing_and_truncated_files(tmp_path, gguf_file):
    text = tmp_path / "model.gguf"
    text.write_text("this is not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    good = gguf_file("tiny-qwen2", "q8_0").read_bytes()
    (tmp_path / "cut-data.gguf").write_bytes(good[:len(good) * 3 // 5])
    (tmp_path / "cut-head.gguf").write_bytes(good[:300])
    cases = [(text, "not a GGUF file"), (tmp_path / "empty.gguf", "not a GGUF file"),
             (tmp_path / "none.gguf", "no such file"),
             (tmp_path / "cut-data.gguf", "truncated GGUF file: tensor '.*' ends at byte"),
             (tmp_path / "cut-head.gguf", "truncated GGUF file .it ends inside the header")]
    for path, match in cases:
        with pytest.raises(CheckpointError, match=match) as exc:
            GGUFModel(path)
        _one_line(exc, path)
    assert is_gguf(gguf_file("tiny-qwen2")) and not is_gguf(text)
    assert not is_gguf(tmp_path / "none.gguf")


def _broken(tmp_path, family="tiny-llama31", ttype="q8_0", **edits):
    spec = gguf_spec(FIXTURES / family, ttype)
    for key, value in edits.get("meta", {}).items():
        if value is None:
            del spec.meta[key]
        else:
            spec.set(key, *value) if isinstance(value, tuple) else spec.set(key, value)
    for name, value in edits.get("tensors", {}).items():
        if value is None:
            del spec.tensors[name]
        else:
            spec.tensor(name, *value)
    if "arch" in edits:
        spec.arch = edits["arch"]
        spec.meta.pop("general.architecture", None)
    return spec.write(tmp_path / "broken.gguf")


@pytest.mark.parametrize("edits, error, match", [
    ({"arch": "phi3"}, ModelError, "architecture 'phi3' is not supported"),
    ({"meta": {"llama.embedding_length": None}}, CheckpointError,
     "missing metadata key 'llama.embedding_length'"),
    ({"meta": {"llama.attention.head_count_kv": ([2, 2], V.ARRAY, V.UINT32)}}, CheckpointError,
     "must be one integer"),
    ({"meta": {"llama.attention.head_count_kv": 3}}, ModelError, "not a multiple"),
    ({"meta": {"llama.vocab_size": 300}}, CheckpointError, "vocab_size is 300"),
    ({"meta": {"llama.rope.scaling.type": "yarn"}}, ModelError, "rope scaling 'yarn'"),
    ({"meta": {"llama.rope.dimension_count": 8}}, ModelError, "partial rotary"),
    ({"tensors": {"token_embd.weight": None}}, CheckpointError,
     "missing tensor 'token_embd.weight'"),
    ({"tensors": {"rope_freqs.weight": (np.array([1, 8, 1, 8, 1, 8, 1, 8], np.float32),)}},
     ModelError, "rope_freqs"),
])
def test_bad_metadata_is_refused_on_open(edits, error, match, tmp_path):
    path = _broken(tmp_path, **edits)
    with pytest.raises(error, match=match) as exc:
        GGUFModel(path)
    _one_line(exc, path)


@pytest.mark.parametrize("edits, match", [
    ({"tensors": {"blk.0.attn_q.weight": (np.zeros((64, 44), np.uint8), Q.Q5_0)}},
     "tensor 'blk.0.attn_q.weight' is Q5_0, which einpage does not read"),
    ({"tensors": {"blk.1.attn_k.weight": (np.zeros((16, 64), np.float32),)}},
     r"tensor 'blk.1.attn_k.weight' has shape \(16, 64\), but the metadata makes it \(32, 64\)"),
    ({"tensors": {"blk.0.ffn_up.weight": None}}, "missing tensor 'blk.0.ffn_up.weight'"),
    ({"tensors": {"blk.1.ffn_down_exps.weight": None}}, "missing tensor"),
])
def test_bad_tensors_are_refused_by_check_and_reads(edits, match, tmp_path):
    moe = "blk.1.ffn_down_exps.weight" in edits["tensors"]
    family = "tiny-mixtral" if moe else "tiny-llama31"
    path = _broken(tmp_path, family, **edits)
    model = GGUFModel(path)  # opening reads no tensor
    for call in (model.weights.check, model.storages):
        with pytest.raises(CheckpointError, match=match) as exc:
            call()
        _one_line(exc, path)
    name = {"blk.0.attn_q.weight": "layers.0.wq", "blk.1.attn_k.weight": "layers.1.wk",
            "blk.0.ffn_up.weight": "layers.0.w_up",
            "blk.1.ffn_down_exps.weight": "layers.1.experts.0.w_down"}[next(iter(edits["tensors"]))]
    with pytest.raises(CheckpointError, match=match):
        model.weights(name)
    with pytest.raises(CheckpointError, match="'nope' is not a weight of this model"):
        model.weights("nope")


@pytest.mark.parametrize("family, meta, match", [
    ("tiny-llama-f32", {}, "carries no tokenizer"),
    ("tiny-qwen2", {"tokenizer.ggml.pre": "deepseek-coder"},
     "BPE pre-tokenizer 'deepseek-coder' is not supported"),
    ("tiny-qwen2", {"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert' is not supported"),
    ("tiny-qwen2", {"tokenizer.ggml.eos_token_id": 999}, "999 is not a token id"),
    ("tiny-qwen2", {"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
])
def test_bad_tokenizers_are_refused(family, meta, match, tmp_path):
    path = _broken(tmp_path, family, "f32", meta=meta)
    with pytest.raises(CheckpointError, match=match) as exc:
        GGUFModel(path).codec()
    _one_line(exc, path)


# ------------------------------------------------------------------ llama.cpp's own files

def check_llamacpp_record(record: Path) -> None:
    """Everything einpage reads of the files tests/fixtures/make_gguf.py made with llama.cpp
    (`record`: their llamacpp.json): the config is the HF fixture's (but Mistral's window,
    which llama.cpp's converter does not carry), every weight is the HF weight (exactly where
    dense; where packed, the bytes of einpage's `quantize`: llama.cpp's converter (Q8_0) and
    its C quantizer (Q4_0, Q4_1) round as einpage does), the files are what
    tests/gguf_files.py writes, and the tokenizations are llama.cpp's."""
    info = json.loads(record.read_text())
    src = FIXTURES / info["family"]
    cfg, hf = _hf(info["family"])
    for kind, entry in info["files"].items():
        model = GGUFModel(record.parent / entry["file"])
        got = model.config
        if (got.family, cfg.family) == ("llama", "mistral"):
            assert got.sliding_window is None
            cfg = dataclasses.replace(cfg, family="llama", sliding_window=None)
        assert _fields(got) == _fields(cfg), kind
        model.weights.check()
        storages = model.storages()
        for name, slot in model.slots.items():
            got_w, want = model.weights(name), np.asarray(hf(name)).astype(np.float32)
            storage = storages.get(name)
            if storage is None:
                assert np.array_equal(got_w, want.astype(got_w.dtype)), (kind, name)
            else:
                assert np.array_equal(got_w, quantize(want, storage)), (kind, name)
        spec = gguf_spec(src, kind)
        assert set(spec.tensors) == set(model.tensors), kind
        for name, (values, qtype) in spec.tensors.items():
            t = model.tensors[name]
            assert t.type == qtype.name, (kind, name)
            assert np.array_equal(model.data[t.offset:t.offset + t.nbytes],
                                  values.reshape(-1).view(np.uint8)), (kind, name)
        mine = {k: v[0] for k, v in spec.meta.items() if not k.startswith("general.")}
        theirs = {k: v for k, v in model.metadata.items() if not k.startswith("general.")}
        assert set(mine) == set(theirs), kind
        for key, value in mine.items():
            if isinstance(value, float):
                assert theirs[key] == pytest.approx(value, rel=1e-7), (kind, key)
            else:
                assert np.array_equal(theirs[key], value), (kind, key)
    tok = info.get("tokenizer")
    model = GGUFModel(record.parent / info["files"]["f32"]["file"])
    if tok is None:
        with pytest.raises(CheckpointError, match="no tokenizer"):
            model.codec()
        return
    codec = model.codec()
    assert (codec.bos_id, codec.eos_id) == (tok["bos"], tok["eos"])
    assert codec.encode(tok["prompt_text"]) == tok["prompt_ids_llamacpp"]
    assert codec.encode(tok["sentence"]) == tok["sentence_ids_add_special"]
    assert codec.decode(tok["sentence_ids_no_special"]) == tok["sentence_detokenized"]
    assert codec.decode(tok["prompt_ids_llamacpp"][1:]) == tok["prompt_text"]


REAL = sorted((FIXTURES / "gguf").glob("*/llamacpp.json"))

if REAL:  # tests/fixtures/make_gguf.py writes them with llama.cpp; without them, no test here
    @pytest.mark.parametrize("record", REAL, ids=lambda p: p.parent.name)
    def test_llamacpp_files(record):
        check_llamacpp_record(record)
