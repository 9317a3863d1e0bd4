"""The tools agree on every checkpoint kind: convert (to torch, hf, universal) and generate
read a save directory, an iter_ directory, a universal checkpoint, a torch export and a
Hugging Face directory made from one small trained checkpoint, and give the same weights
and the same greedy text; anything else is refused with one wording."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_texts, make_trainer, run_distributed
from megazero.checkpoint.base import ACCEPTED
from megazero.checkpoint.load import open_checkpoint
from megazero.convert import main as convert_main
from megazero.data.tokenizer import build_tokenizer, train_gpt2bpe
from megazero.generate import main as generate_main

KINDS = ["save", "iter", "universal", "torch", "hf"]
WEIGHTS_ONLY = {"torch", "hf"}


def _train(save_dir: str, tokenizer: str) -> None:
    make_trainer(["--data.mock", "true", "--train.iters", "3", "--checkpoint.save", save_dir, "--parallel.tp", "2",
                  "--data.tokenizer", tokenizer]).run()


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict[str, str]:
    """The five kinds, each made from one tiny tp2 checkpoint trained 3 steps."""
    tmp = tmp_path_factory.mktemp("kinds")
    save = str(tmp / "save")
    run_distributed(_train, 2, save, train_gpt2bpe(make_texts(400), 400, tmp / "bpe"))
    paths = {"save": save, "iter": os.path.join(save, "iter_0000003")}
    for kind, to, out in [("universal", "universal", "uni"), ("torch", "torch", "model.pt"), ("hf", "hf", "hf")]:
        paths[kind] = str(tmp / out)
        convert_main(["--load", save, "--to", to, "--output", paths[kind]])
    return paths


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_convert_reads_every_kind(kinds, kind, tmp_path, capsys):
    source = kinds[kind]
    out = tmp_path / "new" / "dir"  # parent folders are created
    convert_main(["--load", source, "--to", "torch", "--output", str(out / "model.pt")])
    _same_tensors(torch.load(str(out / "model.pt"), weights_only=True),
                  torch.load(kinds["torch"], weights_only=True))
    exported = build_tokenizer(open_checkpoint(str(out / "model.pt")).tokenizer)
    assert exported.identity() == build_tokenizer(open_checkpoint(kinds["save"]).tokenizer).identity()

    convert_main(["--load", source, "--to", "hf", "--output", str(out / "hf")])
    _same_tensors(load_file(str(out / "hf" / "model.safetensors")),
                  load_file(os.path.join(kinds["hf"], "model.safetensors")))
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"} <= set(os.listdir(out / "hf"))

    universal = str(out / "uni")
    if kind in WEIGHTS_ONLY:
        with pytest.raises(SystemExit) as e:
            convert_main(["--load", source, "--to", "universal", "--output", universal])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "holds model weights only" in err and err.count("\n") == 1
        assert not os.path.exists(universal)
    else:
        convert_main(["--load", source, "--to", "universal", "--output", universal])
        for name in ("master", "exp_avg", "exp_avg_sq"):
            _same_tensors(load_file(os.path.join(universal, f"{name}.safetensors")),
                          load_file(os.path.join(kinds["universal"], f"{name}.safetensors")))


def _greedy(path: str, capsys, max_new_tokens: int = 8) -> tuple[str, str]:
    generate_main(["--load", path, "--prompt", "the model", "--temperature", "0",
                   "--max-new-tokens", str(max_new_tokens)])
    out = capsys.readouterr()
    return out.out, out.err


def test_generate_reads_every_kind_with_the_same_text(kinds, capsys):
    texts = {kind: _greedy(kinds[kind], capsys) for kind in KINDS}
    assert texts["save"][0].startswith("the model") and len(texts["save"][0]) > len("the model\n")
    assert all(text == texts["save"] for text in texts.values()), texts


def test_generate_warns_when_asked_for_more_than_fits(kinds, capsys):
    text, err = _greedy(kinds["torch"], capsys, max_new_tokens=200)
    assert err.count("\n") == 1 and err.startswith("warning: --max-new-tokens 200 does not fit")
    assert "model.seq_length is 64" in err
    assert text.strip()


@pytest.mark.parametrize("tool", ["convert", "generate"])
def test_not_a_checkpoint_has_one_wording(tmp_path, capsys, tool):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for bad in ("empty", "notes.txt", "missing"):
        path = str(tmp_path / bad)
        with pytest.raises(SystemExit) as e:
            if tool == "convert":
                convert_main(["--load", path, "--to", "torch", "--output", str(tmp_path / "out.pt")])
            else:
                generate_main(["--load", path, "--prompt", "x"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: '{path}' is not a checkpoint (") and err.strip().endswith(ACCEPTED)


def test_iteration_picks_a_checkpoint_of_a_save_directory(kinds):
    from megazero.checkpoint.sharded import CheckpointError
    assert open_checkpoint(kinds["save"], 3).ckpt == kinds["iter"]
    with pytest.raises(CheckpointError, match=r"has no iter_0000005 \(complete checkpoints: iter_0000003\)"):
        open_checkpoint(kinds["save"], 5)
    with pytest.raises(CheckpointError, match="holds none; pass the checkpoint itself without --iteration"):
        open_checkpoint(kinds["universal"], 3)
