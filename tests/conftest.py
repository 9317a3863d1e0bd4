"""Fixtures shared by the test folders: the tokenizers trained on the small corpus, and the data
preprocessing script loaded once. The plain helpers (config and trainer builders, spawning ranks,
the corpus) are in tests/helpers.py, which every test module imports from; pytest puts tests/
on sys.path for this file, so `from helpers import ...` works in every folder below it."""

from __future__ import annotations

import pytest

from helpers import HF_TINY_GPT2, SAMPLES, load_script, make_texts, save_random_hf
from megazero.data.tokenizer import train_gpt2bpe, train_sentencepiece


@pytest.fixture(scope="session")
def bpe_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_gpt2bpe(texts, 400, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def spm_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_sentencepiece(texts, 320, tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face directory holding only a tokenizer.json in Llama 3's style (byte-level BPE,
    <|begin_of_text|> added in front by its post-processor, <|end_of_text|> the eos of
    tokenizer_config.json), trained offline on the small corpus: 300 ids in all."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(make_texts(400) + SAMPLES, trainers.BpeTrainer(
        vocab_size=298, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    path = tmp_path_factory.mktemp("llama3-tokenizer")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))
    return str(path)


@pytest.fixture(scope="module")
def cli():
    """preprocess_data.py, loaded once."""
    return load_script("preprocess_data")


@pytest.fixture(scope="session")
def hf_tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random GPT-2 of HF_TINY_GPT2 with non-trivial LayerNorms and biases, saved as safetensors
    (never written to: the runs that start from it read it)."""
    return save_random_hf(tmp_path_factory.mktemp("hf-gpt2"), **HF_TINY_GPT2)
