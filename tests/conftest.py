"""What several test modules share: the one config builder (megazero.harness.configs, which the
benchmark scripts use too) and the one trainer builder, the small corpus and the tokenizers
trained on it, and the scripts' loader and the data scripts' runner.

The builders and helpers are plain functions that test modules import (`from conftest import
make_trainer`): the builders also run inside spawned gloo ranks, where no fixture exists and
tests/distributed.py finds a rank's function by its module path. The fixtures below are found
by pytest and never imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pytest

from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter, loss_mask_prefix
from megazero.data.tokenizer import train_gpt2bpe, train_sentencepiece
from megazero.harness.configs import TINY_CONFIG, make_config

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- config and trainer


def make_trainer(args: Sequence[str] = (), base: str | dict = TINY_CONFIG):
    """A Trainer of make_config(args, base) in a spawned rank: checked for this process group's
    world, on the grid its parallel section asks for. The start-up lines it prints while it is
    built are dropped."""
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = make_config(args, base, world=dist.get_world_size())
    with contextlib.redirect_stdout(io.StringIO()):
        return Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, cp=cfg.parallel.cp))


def make_grid(tp: int):
    """This spawned rank's grid of tp x dp (pp 1) on the gloo world it joined, for tests of
    single layers (a trainer builds its own)."""
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    grid = ProcessGrid(tp=tp, pp=1, dp=dist.get_world_size() // tp, rank=dist.get_rank())
    grid.build_groups()
    return grid


# ----------------------------------------------------------------------------- a small corpus

WORDS = (
    "the of and to in is was for on that with as by at from model data token train layer "
    "parallel pipeline tensor weight gradient loss sample batch sequence document corpus "
    "python function class module value error result file line text word number list"
).split()
SAMPLES = [
    "Hello, world!",
    "naïve café — ünïcode 日本語 ✓",
    "line one\nline two\n\n    indented\tand tabbed  ",
    "",
]
# Prompt/completion examples for fine-tuning data.
EXAMPLES = [{"prompt": "Question: what is two and two?\nAnswer:", "completion": " Four."},
            {"prompt": "", "completion": "An example without a prompt."},
            {"prompt": "Name a colour.", "completion": " Blue, like the sky over the sea."}]


def make_texts(n: int, seed: int = 0) -> list[str]:
    """n short English-like documents of 5 to 60 words, deterministic."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(5, 60)))
        docs.append(" ".join(words).capitalize() + ".")
    return docs


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def write_masked(prefix: Path, lengths: list[int], seed: int = 0) -> Path:
    """Examples whose prompt tokens are even and completion tokens odd, so that in any sample
    the loss mask must equal token % 2 (padding, token 0, has mask 0 too)."""
    rng = np.random.default_rng(seed)
    with (IndexedDatasetWriter(prefix, np.uint16) as tokens,
          IndexedDatasetWriter(loss_mask_prefix(prefix), np.uint8) as mask):
        for n in lengths:
            n_prompt = int(rng.integers(0, n))
            doc = np.concatenate([2 * rng.integers(1, 50, n_prompt), 2 * rng.integers(0, 50, n - n_prompt) + 1])
            tokens.add_document(doc)
            mask.add_document(doc % 2)
        tokens.finalize()
        mask.finalize()
    return prefix


def documents(prefix: Path) -> list[list[int]]:
    """An indexed dataset's documents as lists of token ids."""
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.fixture(scope="session")
def bpe_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_gpt2bpe(texts, 400, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def spm_spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    texts = make_texts(400) + SAMPLES
    return train_sentencepiece(texts, 320, tmp_path_factory.mktemp("spm"))


# ----------------------------------------------------------------------------- scripts


def load_script(name: str, folder: str = "data_tools"):
    """A script of data_tools/ (or another folder of the repository) as a module, to call its
    functions in-process without putting its folder on sys.path.

    It is registered in sys.modules so that worker processes can unpickle its functions.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(cli, capsys, *args: str) -> tuple[int, str, str]:
    """Run a script's main(ARGS) without its progress bar; its exit code, stdout and stderr."""
    code = cli.main([*args, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def cli():
    """preprocess_data.py, loaded once."""
    return load_script("preprocess_data")
