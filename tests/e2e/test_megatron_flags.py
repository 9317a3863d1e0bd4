"""Megatron-LM launch lines: its GPT pretraining flags as aliases of megazero's keys
(megazero/config/megatron.py), its checkpoint-directory conventions, and a shrunk
Megatron example line that trains at tp 2 x pp 2 and resumes bitwise."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, run_distributed, torchrun
from megazero.config import ConfigError
from megazero.config.megatron import FLAGS, markdown_table, translate
from megazero.data.indexed import IndexedDatasetWriter
from megazero.data.tokenizer import build_tokenizer
from megazero.train.__main__ import load_config


def shrunk_175b_line(prefix: str, tokenizer_dir: str, ckpt: str, iters: int = 4) -> list[str]:
    """Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, every flag kept, sizes shrunk
    (and fp32 instead of --fp16, so that losses compare exactly on CPU)."""
    return ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--attention-backend auto "
            f"--micro-batch-size 2 --global-batch-size 8 --rampup-batch-size 4 4 8 --train-iters {iters} "
            "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 "
            "--lr 6.0e-4 --lr-decay-style cosine --min-lr 6.0e-5 --lr-warmup-fraction .25 --lr-decay-iters 4 "
            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer "
            f"--data-path {prefix} --vocab-file {tokenizer_dir}/vocab.json --merge-file {tokenizer_dir}/merges.txt "
            f"--split 949,50,1 --log-interval 1 --save-interval 2 --eval-interval 2 --eval-iters 1 "
            f"--save {ckpt} --load {ckpt} --tensorboard-dir {ckpt}/tb").split()


@pytest.fixture(scope="module")
def corpus(bpe_spec, tmp_path_factory) -> tuple[str, str]:
    """(dataset prefix, tokenizer directory): 600 random documents in the tokenizer's vocabulary."""
    tokenizer_dir = bpe_spec.split(":", 1)[1]
    vocab = build_tokenizer(bpe_spec).vocab_size
    prefix = str(tmp_path_factory.mktemp("megatron-data") / "corpus_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(600):
            writer.add_document(rng.integers(0, vocab, int(rng.integers(10, 80))))
        writer.finalize()
    return prefix, tokenizer_dir


def test_example_line_maps_to_megazero_keys(corpus, tmp_path, capsys):
    cfg = load_config(None, None, shrunk_175b_line(*corpus, str(tmp_path / "ckpt")), 0, 4)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length, m.init_std) == (4, 64, 4, 32, 0.006)
    assert (p.tp, p.pp, cfg.zero.stage) == (2, 2, 1)  # --use-distributed-optimizer: ZeRO 1
    assert (t.micro_batch_size, t.global_batch_size, t.rampup_batch_size, t.iters) == (2, 8, [4, 4, 8], 4)
    assert (o.lr, o.min_lr, o.decay_style, o.warmup_fraction, o.decay_iters) == (6e-4, 6e-5, "cosine", 0.25, 4)
    assert (o.weight_decay, o.beta1, o.beta2, o.clip_grad) == (0.1, 0.9, 0.95, 1.0)
    assert cfg.data.prefix == [corpus[0]] and cfg.data.split == "949,50,1"
    assert cfg.data.tokenizer == f"gpt2bpe:{corpus[1]}/vocab.json,{corpus[1]}/merges.txt"
    assert (cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.interval) == (str(tmp_path / "ckpt"),) * 2 + (2,)
    assert cfg.logging.tensorboard == str(tmp_path / "ckpt" / "tb")
    assert capsys.readouterr().err.strip().splitlines() == [
        "Megatron-LM launch line: Megatron's defaults for what it leaves out: model.dropout 0.1",
        "warning: Megatron-LM flags accepted with no effect here (kernel and implementation choices megazero makes "
        "itself): --attention-backend"]


def test_gpt2_example_line_maps(corpus, tmp_path, capsys):
    """examples/pretrain_gpt_distributed_with_mp.sh (the 345M GPT-2), shrunk: its older flags too."""
    line = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 "
            "--num-attention-heads 4 --micro-batch-size 2 --global-batch-size 8 --seq-length 32 "
            "--max-position-embeddings 32 --train-iters 20 --lr-decay-iters 16 "
            f"--save {tmp_path} --load {tmp_path} --data-path {corpus[0]} --vocab-file {corpus[1]}/vocab.json "
            f"--merge-file {corpus[1]}/merges.txt --data-impl mmap --split 949,50,1 --distributed-backend nccl "
            "--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 "
            "--lr-warmup-fraction .01 --checkpoint-activations --log-interval 100 --save-interval 10000 "
            "--eval-interval 1000 --eval-iters 10 --fp16").split()
    cfg = load_config(None, None, line, 0, 4)
    assert (cfg.train.recompute, cfg.train.precision, cfg.optim.warmup_fraction, cfg.optim.weight_decay) == (
        "full", "fp16", 0.01, 0.01)
    assert capsys.readouterr().err.strip().endswith("makes itself): --data-impl, --distributed-backend")


@pytest.mark.parametrize("args, message", [
    ("--num-layer 2", "unknown flag --num-layer: neither a megazero key nor a Megatron-LM flag megazero reads; "
                      "did you mean --num-layers (megazero's model.num_layers)?"),
    ("--tensor-parallel-size 2", "did you mean --tensor-model-parallel-size (megazero's parallel.tp)?"),
    ("--micro_batch_size 2", "did you mean --micro-batch-size (megazero's train.micro_batch_size)?"),
    ("--num_heads 4", "did you mean --model.num_heads?"),
    ("--normalization Apex", "--normalization Apex: megazero builds LayerNorm, RMSNorm; Apex is outside its reach"),
    ("--position-embedding-type relative", "--position-embedding-type relative: megazero builds learned_absolute, "
                                           "rope; relative is outside its reach"),
    ("--num-query-groups 2", "--num-query-groups needs --group-query-attention (Megatron-LM ignores it without); "
                             "add it"),
    ("--fp16 --bf16", "--fp16 and --bf16 both set train.precision (to fp16 and bf16); pass one of them"),
    ("--hidden-dropout 0.1 --attention-dropout 0.2", "--hidden-dropout 0.1 and --attention-dropout 0.2 both set "
                                                     "model.dropout"),
    ("--rampup-batch-size 16 16", "--rampup-batch-size takes 3 values, got 2: 16 16"),
    ("--fp16=true", "--fp16 is a switch and takes no value"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file v.json", "--tokenizer-type GPT2BPETokenizer needs --vocab-file "
                                                              "and --merge-file"),
])
def test_bad_flags_are_one_line(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        translate(args.split())


@pytest.mark.parametrize("args, message", [
    ("--max-position-embeddings 2048 --seq-length 1024", r"--max-position-embeddings \(2048\) must equal --seq-length"),
    ("--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
     r"--num-layers-per-virtual-pipeline-stage \(3\) must divide the layers per pipeline stage \(num_layers / pp = "
     r"8 / 2\); pick a divisor of 4"),
])
def test_flags_checked_against_the_built_config(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, None, ["--mock-data", *args.split()], 0, 2)


LLAMA_MODEL = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 4096 "
               "--swiglu --normalization RMSNorm --position-embedding-type rope --no-position-embedding "
               "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
               "--disable-bias-linear --rotary-base 500000 --rotary-percent 1.0 --kv-channels 32 --norm-epsilon 1e-6")


def test_llama_model_flags():
    """Megatron's Llama model flags become the family's model keys; a SwiGLU MLP without
    --ffn-hidden-size gets Megatron's width (8h/3 down to a multiple of 64)."""
    m = load_config(None, None, ["--mock-data", *LLAMA_MODEL.split()], 0, 1).model
    assert (m.activation, m.normalization, m.position_embedding, m.num_query_groups, m.tie_embeddings, m.bias) == (
        "swiglu", "rmsnorm", "rope", 2, False, False)
    assert (m.rope_base, m.layernorm_eps, m.ffn_hidden_size) == (500000.0, 1e-6, 320)
    m = load_config(None, None, ["--mock-data", *LLAMA_MODEL.split(), "--ffn-hidden-size", "384"], 0, 1).model
    assert m.ffn_hidden_size == 384
    m = load_config(None, None, "--mock-data --squared-relu --use-rotary-position-embeddings".split(), 0, 1).model
    assert (m.activation, m.position_embedding, m.ffn_hidden_size, m.bias, m.tie_embeddings) == (
        "squared_relu", "rope", 0, True, True)


@pytest.mark.parametrize("args, message", [
    ("--rotary-percent 0.5", r"--rotary-percent 0.5: megazero rotates all of each head's channels; only "
                             r"--rotary-percent 1.0 is supported"),
    ("--kv-channels 64", r"--kv-channels 64: megazero's head width is --hidden-size / --num-attention-heads "
                         r"\(128 / 4\); drop the flag or set it to that"),
    ("--no-position-embedding --position-embedding-type learned_absolute", "--no-position-embedding without rotary "
                                                                           "positions"),
    ("--max-position-embeddings 16", r"--max-position-embeddings \(16\) is shorter than --seq-length \(32\)"),
])
def test_llama_model_flags_outside_reach_are_one_line(args, message):
    line = LLAMA_MODEL.replace("--max-position-embeddings 4096 ", "").replace("--rotary-percent 1.0 ", "")
    line = line.replace("--kv-channels 32 ", "").replace("--position-embedding-type rope ", "")
    if "learned_absolute" not in args:
        line += " --position-embedding-type rope"
    with pytest.raises(ConfigError, match=message):
        load_config(None, None, ["--mock-data", *line.split(), *args.split()], 0, 1)


def test_flags_that_need_the_whole_config():
    cfg = load_config(None, None, "--mock-data --num-layers 8 --pipeline-model-parallel-size 2 "
                      "--num-layers-per-virtual-pipeline-stage 2 --global-batch-size 8 --micro-batch-size 2 "
                      "--use-distributed-optimizer --zero.stage 2".split(), 0, 2)
    assert (cfg.parallel.vpp, cfg.parallel.schedule, cfg.zero.stage) == (2, "interleaved", 2)


def test_context_parallel_flags():
    base = ("--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --global-batch-size 4 "
            "--hidden-dropout 0 --attention-dropout 0 ")  # ring attention has no dropout yet
    for comm, impl in (("p2p", "ring"), ("a2a", "ulysses")):
        cfg = load_config(None, None, (base + f"--context-parallel-size 2 --cp-comm-type {comm}").split(), 0, 2)
        assert (cfg.parallel.cp, cfg.parallel.cp_impl) == (2, impl)
    with pytest.raises(ConfigError, match="--cp-comm-type allgather has no megazero equivalent"):
        load_config(None, None, (base + "--context-parallel-size 2 --cp-comm-type allgather").split(), 0, 2)


def test_megatron_defaults_for_a_megatron_launch_line_only(tmp_path, capsys):
    """Megatron flags without a config file train with Megatron's dropout, weight decay, beta2 and
    decay (and say so); with a --config file, or without Megatron flags, megazero's defaults stay."""
    cfg = load_config(None, None, ["--mock-data", "--adam-beta2", "0.9"], 0, 1)
    assert (cfg.model.dropout, cfg.optim.weight_decay, cfg.optim.beta2, cfg.optim.decay_style) == (
        0.1, 0.01, 0.9, "linear")
    assert capsys.readouterr().err == ("Megatron-LM launch line: Megatron's defaults for what it leaves out: "
                                       "model.dropout 0.1, optim.weight_decay 0.01, optim.decay_style linear, "
                                       "optim.min_lr 0\n")
    (tmp_path / "c.yaml").write_text("model:\n  num_layers: 2\n")
    cfg = load_config(str(tmp_path / "c.yaml"), None, ["--mock-data"], 0, 1)
    assert (cfg.model.dropout, cfg.optim.weight_decay, cfg.optim.beta2) == (0.0, 0.1, 0.95)
    assert load_config(None, None, ["--data.mock", "true"], 0, 1).model.dropout == 0.0  # megazero's own line
    assert capsys.readouterr().err == ""


APEX_FLAGS = ["--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
              "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--apply-query-key-layer-scaling",
              "--no-query-key-layer-scaling", "--attention-softmax-in-fp32"]
"""Megatron-LM's (and Megatron-DeepSpeed's) flags that choose apex's fused kernels, or guard them."""


def test_flags_naming_apex_kernels_are_accepted_and_named_in_one_line(capsys):
    """A Megatron launch line with every flag that names an apex kernel builds the same config as
    without them, and the one warning line names each (docs/apex.md says why none is needed)."""
    plain = load_config(None, None, ["--mock-data"], 0, 1)
    capsys.readouterr()
    cfg = load_config(None, None, ["--mock-data", *APEX_FLAGS], 0, 1)
    assert cfg == plain
    assert capsys.readouterr().err.splitlines()[-1] == (
        "warning: Megatron-LM flags accepted with no effect here (kernel and implementation choices megazero makes "
        f"itself): {', '.join(APEX_FLAGS)}")


def test_readme_migration_table_is_current():
    assert markdown_table() in open(REPO / "docs" / "migration.md").read(), \
        "docs/migration.md's Megatron-LM table is out of date: run python scripts/update_readme_config.py"
    assert {f.name for f in FLAGS} >= {"--num-layers", "--rampup-batch-size", "--lr-warmup-fraction", "--data-path",
                                       "--tensorboard-dir", "--use-distributed-optimizer", "--attention-backend"}


def test_cli_accepts_a_megatron_line(corpus, tmp_path):
    """`python -m megazero.train` (what scripts/pretrain_gpt.sh runs first) takes the flags as they are."""
    cmd = [sys.executable, "-m", "megazero.train", "--validate-only", "--config-only", "--world-size", "4",
           *shrunk_175b_line(*corpus, str(tmp_path / "ckpt"))]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "config OK for 4 process(es) (files not checked)"
    bad = subprocess.run(cmd + ["--num-layer", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean --num-layers" in bad.stderr


# ----------------------------------------------------------------------------- checkpoints and the end-to-end run


def _train(args: list[str]) -> list[tuple[int, float]]:
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = load_config(None, None, args, dist.get_rank(), dist.get_world_size())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg, ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp))
        records = trainer.run()
    return [(r["iteration"], r["loss"]) for r in records] if trainer.is_logger else []


def _train_and_resume(first: list[str], megatron_dir: str, second: list[str]) -> tuple[list, list]:
    """Both runs in one world: the first saves iterations 2 and 4; the second resumes from a
    directory that holds iteration 2 behind Megatron's pointer file alone."""
    import torch.distributed as dist
    losses = _train(first)
    if dist.get_rank() == 0:
        save = first[first.index("--save") + 1]
        os.makedirs(megatron_dir)
        shutil.copytree(os.path.join(save, "iter_0000002"), os.path.join(megatron_dir, "iter_0000002"))
        with open(os.path.join(megatron_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2\n")
    dist.barrier()
    return losses, _train(second)


def test_megatron_line_trains_at_tp2_pp2_and_resumes(corpus, tmp_path):
    ckpt, megatron_dir = str(tmp_path / "ckpt"), str(tmp_path / "megatron")
    first = shrunk_175b_line(*corpus, ckpt)
    second = shrunk_175b_line(*corpus, str(tmp_path / "ckpt2"))
    second[second.index("--load") + 1] = megatron_dir
    results = run_distributed(_train_and_resume, 4, first, megatron_dir, second)
    whole, resumed = next(r for r in results if r[0])
    assert [i for i, _ in whole] == [1, 2, 3, 4] and whole[-1][1] < whole[0][1]
    assert resumed == whole[2:]  # bitwise: iterations 3 and 4 again, mid batch ramp-up
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "4"
    assert open(os.path.join(ckpt, "latest")).read() == "iter_0000004"
    # --tensorboard-dir: Megatron's scalars, one writer, equal to the losses logged
    from helpers import tensorboard_scalars as _scalars
    lm_loss = _scalars(os.path.join(ckpt, "tb"))["lm loss"]
    assert [step for step, _ in lm_loss] == [1, 2, 3, 4]
    assert all(abs(value - loss) < 1e-6 * abs(loss) for (_, value), (_, loss) in zip(lm_loss, whole, strict=True))


def test_megatron_pointer_files(tmp_path):
    from megazero.checkpoint.base import CheckpointError
    from megazero.checkpoint.sharded import resolve
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12\n")
    (tmp_path / "iter_0000012" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"iter_0000012' is a Megatron-LM checkpoint \(mp_rank_\* files\), "
                                              r"which megazero does not read"):
        resolve(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("soon")
    with pytest.raises(CheckpointError, match=r"holds 'soon', not an iteration number"):
        resolve(str(tmp_path))


@pytest.mark.slow
def test_megatron_line_under_torchrun(corpus, tmp_path):
    """The same line through `torchrun -m megazero.train`, then resumed by running it again."""
    line = shrunk_175b_line(*corpus, str(tmp_path / "ckpt"), iters=2)
    done = torchrun(4, line, str(REPO))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--attention-backend" in done.stderr
    again = torchrun(4, [*line[:line.index("--train-iters") + 1], "4", *line[line.index("--train-iters") + 2:]],
                     str(REPO))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "iteration 2" in again.stdout
