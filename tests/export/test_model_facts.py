"""The facts an LLM file is made of, each read in one place: a model's attention shapes
(pnmix.hf.models.ModelDims), the file's pnmix.* metadata (LlmMetadata), the state tensors' names."""

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="pnmix.hf needs transformers")

from pnmix.config import PnMixConfig  # noqa: E402
from pnmix.errors import PnMixError  # noqa: E402
from pnmix.export.llm_file import LlmFileInfo, LlmMetadata  # noqa: E402
from pnmix.export.tracing import META_PREFIX, state_name  # noqa: E402
from pnmix.hf.models import ModelDims  # noqa: E402
from pnmix.testing import SMALL  # noqa: E402


def llama_config(**fields):
    base = dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, hidden_size=256,
                max_position_embeddings=2048)
    return SimpleNamespace(**{**base, **fields})


def test_head_dim_falls_back_to_hidden_size_over_query_heads():
    assert ModelDims.from_config(llama_config(head_dim=None)).head_dim == 256 // 8
    assert ModelDims.from_config(llama_config()).head_dim == 32  # no head_dim field at all
    assert ModelDims.from_config(llama_config(head_dim=64)).head_dim == 64  # a stated one wins


def test_model_dims_read_the_config():
    dims = ModelDims.from_config(llama_config(head_dim=64))
    assert dims == ModelDims(layers=3, q_heads=8, kv_heads=2, head_dim=64, max_positions=2048)
    # no num_key_value_heads: multi-head attention, one KV head per query head
    assert ModelDims.from_config(llama_config(num_key_value_heads=None)).kv_heads == 8
    assert ModelDims.from_config(llama_config(max_position_embeddings=None)).max_positions == 0


def test_kv_bytes_are_k_and_v_of_every_layer_and_kv_head():
    dims = ModelDims(layers=3, q_heads=8, kv_heads=2, head_dim=64, max_positions=0)
    assert dims.kv_bytes(100, 2) == 2 * 3 * 2 * 64 * 100 * 2
    assert dims.kv_bytes(100, 4, batch=5) == 5 * dims.kv_bytes(100, 4)
    assert dims.kv_bytes(0, 2) == 0


def _metadata():
    return LlmMetadata(config=PnMixConfig.from_mapping(SMALL), max_seq_len=96, batch=1, model="tiny",
                       model_type="llama", layers=2, q_heads=4, kv_heads=2, head_dim=16, vocab_size=128,
                       dtype="fp32", tokenizer_sha256="ab" * 32, data_sha256="cd" * 32)


def test_metadata_written_reads_back_equal():
    written = _metadata()
    props = written.to_props()
    assert list(props) == list(LlmMetadata.keys())
    assert props["kind"] == "llm" and all(isinstance(v, str) for v in props.values())
    assert LlmMetadata(**LlmMetadata.values_from_props(props)) == written
    info = LlmFileInfo(**LlmMetadata.values_from_props(props), path=Path("m.onnx"))
    assert info.to_props() == props
    assert (info.layout.max_seq_len, info.layout.kv_heads, info.layout.head_dim) == (96, 2, 16)
    assert not any(key.startswith(META_PREFIX) for key in props)  # the prefix is the file's, added once


def test_the_files_room_is_checked_in_one_place():
    info = LlmFileInfo(**LlmMetadata.values_from_props(_metadata().to_props()), path=Path("m.onnx"))
    info.check_room(90, 6)
    with pytest.raises(PnMixError, match=r"capacity exceeded: 90 \+ 7 tokens > max_seq_len 96 of m.onnx: the prompt"):
        info.check_room(90, 7, "the prompt")


def test_state_names_of_both_files():
    assert (state_name("key_codes"), state_name("key_codes", present=True)) == ("key_codes", "present_key_codes")
    assert (state_name("pair_mask", 3), state_name("pair_mask", 3, present=True)) == ("past.3.pair_mask",
                                                                                     "present.3.pair_mask")
