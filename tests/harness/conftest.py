"""Saved random models the harness's CLI tests load by path (made once per session)."""

import pytest


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory):
    """bench's random Llama (2 layers, hidden 64, 4 query / 2 KV heads of 32), saved."""
    from pnmix.bench.generate import random_llama

    folder = tmp_path_factory.mktemp("random-llama")
    random_llama(2, 64, 4, 2, 32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_1k_dir(tmp_path_factory):
    """pnmix.testing's tiny Llama (seed 3) with 1024 positions, saved."""
    from pnmix.testing import tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama-1k")
    model = tiny_llama(seed=3)
    model.config.max_position_embeddings = 1024
    model.save_pretrained(folder)
    return folder
