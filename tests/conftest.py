"""Fixtures shared by the test folders: the tokenizers trained on the small corpus, and the data
preprocessing script loaded once. The plain helpers (config and trainer builders, spawning ranks,
the corpus) are in tests/helpers.py, which every test module imports from; pytest puts tests/
on sys.path for this file, so `from helpers import ...` works in every folder below it."""

from __future__ import annotations

import pytest

from helpers import SAMPLES, load_script, make_texts
from megazero.data.tokenizer import train_gpt2bpe, train_sentencepiece


@pytest.fixture(scope="session")
def bpe_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_gpt2bpe(texts, 400, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def spm_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_sentencepiece(texts, 320, tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def cli():
    """preprocess_data.py, loaded once."""
    return load_script("preprocess_data")

