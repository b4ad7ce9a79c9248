import json

import pytest

from pnmix.config import CONFIG_FIELDS, PnMixConfig, run_config
from pnmix.errors import PnMixError
from pnmix.manifest import load_manifest


def test_manifest_config_fills_every_spec_field():
    manifest = load_manifest()
    config = PnMixConfig.from_manifest(manifest)
    for name, value in manifest["protocol"]["config"].items():
        assert getattr(config, name) == value
    assert (config.key_high_bits, config.key_low_bits) == (3, 1)  # docs/METHOD.md section 1.4: the manifest is silent
    assert set(CONFIG_FIELDS) >= set(manifest["protocol"]["config"])


def test_json_file_overrides_manifest_fields_and_protocol_lengths(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"pair_layout": "half", "value_bits": 4, "prefill_tokens": 200}))
    run = run_config(load_manifest(), path)
    assert run.config.pair_layout == "half" and run.config.value_bits == 4
    assert run.config.group_size == 128  # untouched fields keep the manifest's values
    assert (run.prefill_tokens, run.decode_tokens) == (200, 64)


@pytest.mark.parametrize("field, value, words", [
    ("group_size", 100, "multiple of 8"),
    ("group_size", 0, "group_size"),
    ("residual_size", 64, ">= group_size"),
    ("high_ratio", 1.5, "[0, 1]"),
    ("value_bits", 9, "1..8"),
    ("key_high_bits", 0, "1..8"),
    ("pair_layout", "diagonal", "adjacent, half"),
    ("sink_tokens", -1, ">= 0"),
    ("group_size", "128", "integer"),
])
def test_invalid_values_are_rejected_naming_the_field(field, value, words):
    with pytest.raises(PnMixError) as err:
        PnMixConfig(**{field: value})
    assert field in str(err.value) and words in str(err.value)


def test_unknown_field_is_an_error_not_a_silent_typo():
    with pytest.raises(PnMixError, match="unknown config field 'grup_size'"):
        PnMixConfig.from_mapping({"grup_size": 64})


@pytest.mark.parametrize("fields, head_dim, words", [
    ({"value_group_size": 24}, 32, "divide head_dim"),
    ({"value_bits": 3, "value_group_size": 4}, 4, "multiple of 8"),
    ({}, 31, "even"),
])
def test_head_dim_checks(fields, head_dim, words):
    with pytest.raises(PnMixError, match=words):
        PnMixConfig(**fields).check_head_dim(head_dim)


def test_value_block_never_spans_heads():
    assert PnMixConfig(value_group_size=128).value_block(32) == 32
    assert PnMixConfig(value_group_size=8).value_block(32) == 8
