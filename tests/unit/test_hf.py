"""Hugging Face GPT-2 interchange: export loads in transformers with equal logits; import back."""

from __future__ import annotations

import pytest
import torch

from helpers import SAMPLES, make_texts
from megazero.checkpoint.export import write_hf
from megazero.checkpoint.hf import open_hf
from megazero.checkpoint.tensors import fit_vocab
from megazero.config import ModelConfig
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe, train_sentencepiece
from megazero.model.gpt import GPT
from megazero.parallel.placement import placement

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=300)


def _model() -> GPT:
    m = GPT(CFG)
    m.init_weights(3)
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a mapping mistake shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return m.eval()


def _write(model: GPT, path) -> None:
    sd = model.state_dict()
    write_hf(str(path), sd.items(), {n: tuple(t.shape) for n, t in sd.items()}, CFG)


def test_export_loads_in_transformers_with_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = _model()
    _write(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)[..., :300]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-4


def test_import_roundtrip(tmp_path):
    model = _model()
    _write(model, tmp_path)
    ckpt = open_hf(str(tmp_path))
    cfg, tensors = ckpt.model_config, ckpt.tensors()
    assert cfg == ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=300)
    fresh = GPT(cfg)
    shapes = {n: placement(p).full_shape for n, p in fresh.named_parameters()}
    loaded = {n: fit_vocab(n, t, shapes[n]) for n, t in tensors}
    fresh.load_state_dict(loaded, strict=True)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


TOKENIZERS = {  # name: (texts, output folder) -> spec
    "gpt2bpe": lambda texts, out: train_gpt2bpe(texts, 400, out),
    "sentencepiece_bpe": lambda texts, out: train_sentencepiece(texts, 320, out),
    "sentencepiece_unigram": lambda texts, out: train_sentencepiece(texts, 320, out, "unigram"),
    "sentencepiece_defaults": lambda texts, out: _foreign_sentencepiece(texts, out),
}


def _foreign_sentencepiece(texts: list[str], out, **options) -> str:
    """A model with SentencePiece's own defaults (NFKC map, extra whitespace removed), as
    tokenizers trained outside megazero (e.g. Llama's) have."""
    import sentencepiece as spm
    out.mkdir()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(out / "m"), vocab_size=400,
                                   byte_fallback=True, hard_vocab_limit=False, minloglevel=2, **options)
    return f"sentencepiece:{out / 'm.model'}"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_exported_tokenizer_encodes_like_megazero_in_transformers(tmp_path, name):
    """AutoTokenizer.from_pretrained(export) gives megazero's ids and text back."""
    from megazero.checkpoint.export import write_hf_tokenizer
    from megazero.data.tokenizer import spec_of_directory
    transformers = pytest.importorskip("transformers")
    ours = build_tokenizer(TOKENIZERS[name](make_texts(300) + SAMPLES, tmp_path / "tok"))
    export = tmp_path / "export"
    write_hf_tokenizer(ours, str(export), 1 << 16)
    theirs = transformers.AutoTokenizer.from_pretrained(str(export))
    probe = make_texts(20, seed=9) + SAMPLES + ["  leading and   trailing  ", "unseen: zqxj 😀 ☃ ＡＢＣ ①",
                                                "x" * 40]
    for text in probe:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
    assert theirs.eos_token_id == ours.eod
    assert build_tokenizer(spec_of_directory(str(export))).identity() == ours.identity()  # megazero reads it back


def test_tokenizer_without_exact_equivalent_is_refused(tmp_path):
    from megazero.data import DataError
    from megazero.data.hf_tokenizer import hf_tokenizer_files
    spec = _foreign_sentencepiece(make_texts(100), tmp_path / "tok", user_defined_symbols=["[SEP]"])
    with pytest.raises(DataError, match=r"user-defined pieces \(\[SEP\]\)"):
        hf_tokenizer_files(build_tokenizer(spec), 64)
