"""Megatron-LM launch lines: its GPT pretraining flags as aliases of megazero's keys
(megazero/config/megatron.py), its checkpoint-directory conventions, and a shrunk
Megatron example line that trains at tp 2 x pp 2 and resumes bitwise; the MoE example lines
(Mixtral 8x7B, Qwen3-30B-A3B, shrunk) at pp 2 x ep 2."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, make_trainer, run_distributed, torchrun
from megazero.config import Config, ConfigError, build_config
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
    ("--profile --profile-step-start 6 --profile-step-end 6 --save /tmp/x",
     r"logging.profile_start \(6\) and logging.profile_end \(6\) must satisfy 0 <= start < end"),
    ("--profile --use-pytorch-profiler", "logging.profiler torch writes its trace beside the run's logs: set "
                                         "logging.tensorboard"),
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


def test_group_query_attention_alone_is_multi_query_as_in_megatron(tmp_path, capsys):
    """Issue 46, 4: Megatron's --num-query-groups defaults to 1, so --group-query-attention alone
    is multi-query (megazero used to build plain multi-head attention in silence); the defaults
    line says so. A file's model.num_query_groups wins over Megatron's default."""
    base = "--mock-data --num-attention-heads 4 --hidden-size 64 --group-query-attention".split()
    assert load_config(None, None, base, 0, 1).model.num_query_groups == 1
    assert "model.num_query_groups 1 (--group-query-attention)" in capsys.readouterr().err.splitlines()[0]
    assert load_config(None, None, [*base, "--num-query-groups", "2"], 0, 1).model.num_query_groups == 2
    assert "num_query_groups" not in capsys.readouterr().err
    (tmp_path / "c.yaml").write_text("model:\n  num_query_groups: 2\n")
    assert load_config(str(tmp_path / "c.yaml"), None, base, 0, 1).model.num_query_groups == 2
    (tmp_path / "d.yaml").write_text("model:\n  num_layers: 2\n")
    assert load_config(str(tmp_path / "d.yaml"), None, base, 0, 1).model.num_query_groups == 1
    assert capsys.readouterr().err.strip() == ("Megatron-LM launch line: Megatron's defaults for what it leaves out: "
                                               "model.num_query_groups 1 (--group-query-attention)")


@pytest.mark.parametrize("args, message", [
    ("--rotary-percent 0.5", r"--rotary-percent 0.5: megazero rotates all of each head's channels; only "
                             r"--rotary-percent 1.0 is supported"),
    ("--kv-channels 33", r"rotary embeddings need an even head dimension: model.kv_channels is 33"),
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
        p = cfg.parallel
        trainer = Trainer(cfg, ProcessGrid.create(p.tp, p.pp, cp=p.cp, ep=p.ep, etp=p.expert_tp))
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


@pytest.mark.slow  # suite budget: the Llama 3 example's line trains at tp 2 x pp 2 and resumes by default
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


# ----------------------------------------------------------------------------- the Llama examples


def shrunk_llama3_line(ckpt: str, iters_samples: int = 32) -> list[str]:
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE bf16 (no --fp8-* flags),
    every other flag kept, sizes shrunk, mock data, pipeline parallelism added; fp32 instead of
    --bf16 so that losses compare exactly on CPU."""
    return ("--use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 "
            "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 "
            "--max-position-embeddings 32 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
            "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused "
            "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear "
            f"--micro-batch-size 2 --global-batch-size 8 --train-samples {iters_samples} --lr-decay-samples 32 "
            "--lr-warmup-samples 8 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 "
            "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 "
            "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
            "--empty-unused-memory-level 1 --exit-duration-in-mins 235 "
            "--tensor-model-parallel-size 2 --context-parallel-size 1 --sequence-parallel "
            "--pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
            f"--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --data-cache-path {ckpt}/cache "
            "--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
            "--num-workers 1 --log-interval 1 --eval-iters 1 --eval-interval 2 --save-interval 2 --log-throughput "
            "--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist "
            f"--distributed-timeout-minutes 60 --save {ckpt} --load {ckpt} --tensorboard-dir {ckpt}/tb").split()


def shrunk_llama2_line(log_dir: str, iters: int = 2) -> list[str]:
    """examples/llama/train_llama2.sh's GQA variant (its 70B branch: NUM_KV_HEADS < NUM_HEADS) with
    RECOMPUTE=1, ENABLE_PROFILING=1 and OPTIMIZER=adam, mock data and no SAVE_CKPT_PATH (the script
    then passes --no-save-optim --no-save-rng without --save), sizes shrunk, fp32 for CPU."""
    return ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --context-parallel-size 1 "
            "--num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 128 --untie-embeddings-and-output-weights --position-embedding-type rope "
            "--no-position-embedding --swiglu --disable-bias-linear --init-method-std 0.02 --attention-dropout 0.0 "
            f"--hidden-dropout 0.0 --normalization RMSNorm --micro-batch-size 2 --global-batch-size 8 --train-iters "
            f"{iters} --no-async-tensor-model-parallel-allreduce --no-masked-softmax-fusion "
            "--recompute-num-layers 4 --recompute-granularity full --recompute-method block --no-rope-fusion "
            "--lr 1e-4 --min-lr 1e-5 --lr-decay-iters 4 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0 "
            "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --tokenizer-type NullTokenizer --vocab-size 1000 "
            f"--split 99990,8,2 --dataloader-type cyclic --save-interval 200000 --tensorboard-dir {log_dir} "
            "--log-interval 1 --eval-interval 320000 --eval-iters 10 --num-workers 8 --mock-data "
            "--log-throughput --no-save-optim --no-save-rng "
            "--group-query-attention --num-query-groups 2 --no-gradient-accumulation-fusion --distributed-backend nccl "
            "--distributed-timeout-minutes 120 --overlap-grad-reduce --use-distributed-optimizer "
            "--overlap-param-gather --profile --use-pytorch-profiler --use-flash-attn --sequence-parallel "
            "--use-mcore-models").split()


def test_llama_example_lines_map(tmp_path, capsys):
    cfg = load_config(None, None, shrunk_llama3_line(str(tmp_path / "ckpt")), 0, 4)
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.activation, m.position_embedding, m.rope_base, m.num_query_groups, m.zero_centered_norm) == (
        "swiglu", "rope", 1e6, 2, True)
    assert (m.normalization, m.bias, m.tie_embeddings, m.vocab_size, m.ffn_hidden_size) == (
        "layernorm", False, False, 1000, 160)  # the Llama 3 example keeps Megatron's LayerNorm
    assert (t.iters, o.warmup_samples, o.decay_samples, o.decoupled_lr, o.decoupled_min_lr) == (4, 8, 32, 5e-4, 4.5e-5)
    assert (cfg.zero.reduce_dtype, cfg.zero.stage, cfg.parallel.sequence_parallel, t.exit_duration_minutes) == (
        "bf16", 1, True, 235.0)
    assert cfg.data.tokenizer is None and cfg.data.mock
    warning = capsys.readouterr().err.strip().splitlines()[-1]
    assert warning.startswith("warning: Megatron-LM flags accepted with no effect here") and "--profile" not in warning
    assert (cfg.logging.profiler, cfg.logging.profile_start, cfg.logging.profile_end) == ("nsys", 4, 6)
    cfg = load_config(None, None, shrunk_llama2_line(str(tmp_path / "tb")), 0, 4)
    m, t = cfg.model, cfg.train
    assert (m.normalization, m.num_query_groups, m.ffn_hidden_size, t.recompute, cfg.zero.stage) == (
        "rmsnorm", 2, 160, "full", 1)
    assert (cfg.logging.profiler, cfg.logging.profile_ranks) == ("torch", [0])  # --use-pytorch-profiler
    assert "--dataloader-type cyclic" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    ("--fp8-format hybrid", "--fp8-format: megazero has no FP8 training"),
    ("--fp8-param-gather", "--fp8-param-gather: megazero has no FP8 training"),
    ("--optimizer lamb", "--optimizer lamb: megazero builds adam, sgd, muon"),
    ("--ckpt-format zarr", "--ckpt-format zarr: megazero builds torch, torch_dist"),
    ("--dataloader-type external", "--dataloader-type external: megazero builds single, cyclic"),
    ("--load /nonexistent --exit-on-missing-checkpoint", "--exit-on-missing-checkpoint: --load /nonexistent holds "
                                                          "no checkpoint"),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /nonexistent", "megazero reads a local directory "
                                                                             "holding tokenizer.json"),
])
def test_llama_example_flags_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, None, ["--mock-data", *args.split()], 0, 1)


def test_hugging_face_tokenizer_directory(spm_spec, tmp_path):
    """--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: the directory's tokenizer.model (the
    front-end passes the directory on; the tokenizer reads what it holds)."""
    from megazero.data.tokenizer import build_tokenizer

    (tmp_path / "tokenizer.model").symlink_to(spm_spec.split(":", 1)[1])
    cfg = load_config(None, None, ["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                   str(tmp_path)], 0, 1)
    assert cfg.data.tokenizer == str(tmp_path)
    assert build_tokenizer(cfg.data.tokenizer).kind == "sentencepiece"


def _train_on(prefix: str, tokenizer_dir: str) -> list[tuple[int, float]]:
    return _train(f"--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                  f"--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 2 --train-iters 2 "
                  f"--lr 1e-3 --data-path {prefix} --split 98,2,0 --tokenizer-type HuggingFaceTokenizer "
                  f"--tokenizer-model {tokenizer_dir}".split())


def test_hugging_face_tokenizer_json_directory_preprocesses_and_trains(llama3_tokenizer_dir, tmp_path):
    """A Llama 3 style directory holding only tokenizer.json: preprocess_data.py and training both
    take it through Megatron's flags (the dataset's sidecar names the same tokenizer)."""
    from helpers import make_texts, write_jsonl
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", llama3_tokenizer_dir]
    cfg = load_config(None, None, ["--mock-data", *flags], 0, 1)
    assert cfg.data.tokenizer == llama3_tokenizer_dir  # the directory: the tokenizer reads what it holds
    corpus = write_jsonl(tmp_path / "c.jsonl", make_texts(300))
    done = subprocess.run([sys.executable, str(REPO / "data_tools" / "preprocess_data.py"), "--input", str(corpus),
                           *flags, "--output-prefix", str(tmp_path / "c"), "--append-eod", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    losses = run_distributed(_train_on, 1, str(tmp_path / "c_text_document"), llama3_tokenizer_dir)[0]
    assert [i for i, _ in losses] == [1, 2]


def _embedding_moves(decoupled_lr: str) -> dict[str, float]:
    """How far one step moves the embedding, the output layer and a block's weight."""
    tr = make_trainer(["--train.iters", "1", "--model.tie_embeddings", "false", "--optim.warmup_iters", "0",
                       "--optim.decay_style", "constant", "--optim.lr", "1e-3", *(
                           ["--optim.decoupled_lr", decoupled_lr] if decoupled_lr else [])])
    model = tr.chunks[0]
    names = ("transformer.wte.weight", "lm_head.weight", "transformer.h.0.attn.c_attn.weight")
    before = {n: model.get_parameter(n).detach().clone() for n in names}
    with contextlib.redirect_stdout(io.StringIO()):
        tr.run()
    return {n: float((model.get_parameter(n).detach() - before[n]).abs().max()) for n in names}


def _decoupled_runs() -> list[dict[str, float]]:
    return [_embedding_moves(lr) for lr in ("", "1e-3", "0", "1e-2")]


def test_decoupled_lr_moves_the_embedding_and_output_layer_only():
    """Adam's first step moves each weight by about its LR: --decoupled-lr changes that of the
    input embedding and the output layer, and nothing else; equal to --lr it changes nothing."""
    plain, same, frozen, fast = run_distributed(_decoupled_runs, 1)[0]
    assert same == plain
    assert frozen["transformer.wte.weight"] == frozen["lm_head.weight"] == 0.0
    block = "transformer.h.0.attn.c_attn.weight"
    assert frozen[block] == fast[block] == plain[block]
    for name in ("transformer.wte.weight", "lm_head.weight"):
        assert fast[name] == pytest.approx(10 * plain[name], rel=1e-3)


def _per_token_and_micro_batch_mean(prefix: str) -> tuple[float, float, float]:
    """(logged first loss, hand-computed per-token loss, per-micro-batch mean) of a Megatron line with
    --calculate-per-token-loss on examples whose loss masks count different numbers of tokens."""
    import torch
    import torch.nn.functional as F
    line = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            f"--hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 8 --train-iters 1 "
            f"--data-path {prefix} --tokenizer-type NullTokenizer --vocab-size 128 --calculate-per-token-loss").split()
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer
    cfg = load_config(None, None, line, 0, 1)
    with contextlib.redirect_stdout(io.StringIO()):
        tr = Trainer(cfg, ProcessGrid.create(1, 1))
    samples = [tr.train_ds[i] for i in range(8)]
    tokens = torch.from_numpy(np.stack([s.tokens for s in samples]).astype(np.int64))
    mask = torch.from_numpy(np.stack([s.loss_mask for s in samples]))[:, 1:].double()
    with torch.no_grad():
        logits = tr.chunks[0](tokens[:, :-1])[..., :128].double()
    token_loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none") * mask
    per_micro = [float(token_loss[i:i + 2].sum() / mask[i:i + 2].sum().clamp(min=1)) for i in range(0, 8, 2)]
    with contextlib.redirect_stdout(io.StringIO()):
        logged = tr.run()[0]["loss"]
    return logged, float(token_loss.sum() / mask.sum()), sum(per_micro) / len(per_micro)


def test_calculate_per_token_loss_on_uneven_loss_masks(tmp_path):
    from helpers import write_masked
    lengths = np.random.default_rng(3).integers(5, 60, 100).tolist()
    prefix = str(write_masked(tmp_path / "ft", lengths))
    logged, per_token, micro_mean = run_distributed(_per_token_and_micro_batch_mean, 1, prefix)[0]
    assert logged == pytest.approx(per_token, abs=1e-5)
    assert abs(per_token - micro_mean) > 1e-3  # the masks are uneven enough for the definition to matter


@pytest.mark.slow  # suite budget
def test_llama3_line_trains_at_tp2_pp2_and_resumes(tmp_path):
    """The Llama 3 example's flags at tp 2 x pp 2 (sequence parallel, ZeRO 1): 4 steps of 8 samples
    with TensorBoard scalars and a checkpoint every 2; a run resumed from step 2 repeats steps 3
    and 4 bitwise."""
    ckpt, megatron_dir = str(tmp_path / "ckpt"), str(tmp_path / "megatron")
    first = shrunk_llama3_line(ckpt)
    second = shrunk_llama3_line(str(tmp_path / "ckpt2"))
    second[second.index("--load") + 1] = megatron_dir
    results = run_distributed(_train_and_resume, 4, first, megatron_dir, second)
    whole, resumed = next(r for r in results if r[0])
    assert [i for i, _ in whole] == [1, 2, 3, 4] and whole[-1][1] < whole[0][1]
    assert resumed == whole[2:]
    from helpers import tensorboard_scalars as _scalars
    scalars = _scalars(os.path.join(ckpt, "tb"))
    assert [step for step, _ in scalars["lm loss"]] == [1, 2, 3, 4]
    assert "throughput" in scalars or "learning-rate" in scalars


@pytest.mark.slow
def test_llama2_line_trains_at_tp2_pp2(tmp_path):
    losses = run_distributed(_train, 4, shrunk_llama2_line(str(tmp_path / "tb")))
    whole = next(r for r in losses if r)
    assert [i for i, _ in whole] == [1, 2]


# ----------------------------------------------------------------------------- the MoE examples (issue 45, 8)



def shrunk_mixtral_line(ckpt: str, iters: int = 4) -> list[str]:
    """Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, every flag kept, sizes shrunk,
    pp 4 x ep 8 made pp 2 x ep 2 (4 ranks), mock data with token ids for the Llama 2 tokenizer, fp32
    instead of --bf16 so that losses compare exactly on CPU."""
    return ("--use-mcore-models --disable-bias-linear --seq-length 32 --max-position-embeddings 128 --num-layers 4 "
            "--hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01 "
            "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope "
            "--swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
            "--no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000 "
            "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
            "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --split 99990,8,2 "
            f"--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters {iters} --lr-decay-iters 4 "
            "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 1 --clip-grad 1.0 "
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
            "--use-distributed-optimizer --sequence-parallel "
            f"--log-interval 1 --save-interval 2 --eval-interval 2 --eval-iters 1 --save {ckpt} --load {ckpt} "
            f"--tensorboard-dir {ckpt}/tensorboard --no-load-optim --no-load-rng").split()


def shrunk_qwen3_moe_line(ckpt: str, iters: int = 4) -> list[str]:
    """A Qwen3-30B-A3B Megatron line (48 layers, h 2048, 32 heads of 128 channels, 4 query groups, 128
    experts of width 768, top-8, QK-norm, every layer MoE), shrunk: 4 layers, h 64, 4 heads of 32 channels
    (still not h / heads), 8 experts of width 32, top-2, at pp 2 x ep 2; fp32 for CPU."""
    return ("--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 4 --num-query-groups 2 "
            "--kv-channels 32 --num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --normalization RMSNorm "
            "--position-embedding-type rope --no-position-embedding --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu "
            "--untie-embeddings-and-output-weights --vocab-size 1000 --make-vocab-size-divisible-by 16 "
            "--rotary-base 1000000 --seq-length 32 --max-position-embeddings 4096 "
            "--moe-ffn-hidden-size 32 --moe-router-score-function softmax --moe-router-topk-scaling-factor 1.0 "
            "--moe-router-topk 2 --moe-layer-freq [1,1,1,1] --num-experts 8 --moe-grouped-gemm --moe-router-dtype fp32 "
            "--moe-permute-fusion --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-3 "
            "--moe-token-dispatcher-type alltoall "
            "--mock-data --tokenizer-type NullTokenizer --split 99,1,0 --micro-batch-size 1 --global-batch-size 4 "
            f"--train-iters {iters} --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 1 "
            "--weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 "
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
            "--expert-tensor-parallel-size 1 --use-distributed-optimizer "
            f"--log-interval 1 --save-interval 2 --save {ckpt} --load {ckpt}").split()


def _moe_config(line: list[str]) -> Config:
    """What an MoE line translates to (before validation)."""
    t = translate(line)
    cfg = build_config(t.defaults(has_config_file=False), t.overrides)
    t.apply(cfg)
    return cfg


def test_moe_example_lines_map(tmp_path, capsys):
    cfg = _moe_config(shrunk_mixtral_line(str(tmp_path / "ckpt")))
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_load_balancing, m.moe_aux_loss_coeff, m.moe_layer_freq) == (
        8, 2, "aux_loss", 0.01, 1)
    assert (m.activation, m.normalization, m.num_query_groups, m.ffn_hidden_size, m.moe_ffn_size, m.bias) == (
        "swiglu", "rmsnorm", 2, 224, 224, False)  # Mixtral's experts are as wide as the dense MLP
    assert (p.tp, p.pp, p.ep, p.expert_tp, p.moe_dispatcher, cfg.zero.stage) == (1, 2, 2, 1, "alltoall", 1)
    cfg = _moe_config(shrunk_qwen3_moe_line(str(tmp_path / "ckpt")))
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq, m.moe_load_balancing) == (
        8, 2, 32, [1, 1, 1, 1], "global_aux_loss")
    assert (m.qk_layernorm, m.kv_channels, m.head_dim, m.num_query_groups, m.layernorm_eps) == (True, 32, 32, 2, 1e-6)
    assert (m.moe_router_score_function, m.moe_router_topk_scaling_factor, m.moe_aux_loss_coeff) == (
        "softmax", 1.0, 0.001)
    assert (p.pp, p.ep, p.etp, p.moe_dispatcher) == (2, 2, 1, "alltoall")


def test_mixtral_line_trains_at_pp2_ep2(tmp_path):
    """The Mixtral line, shrunk, trains at pp 2 x ep 2 (4 ranks; experts split over the data ranks,
    ZeRO-1): two logged iterations, finite losses."""
    losses = next(r for r in run_distributed(_train, 4, shrunk_mixtral_line(str(tmp_path / "ckpt"), iters=2)) if r)
    assert [i for i, _ in losses] == [1, 2] and all(0 < loss < 20 for _, loss in losses), losses


@pytest.mark.slow
def test_qwen3_moe_line_trains_at_pp2_ep2(tmp_path):
    """The Qwen3-MoE line (QK-norm, head size, global_aux_loss over the data ranks) at pp 2 x ep 2."""
    losses = next(r for r in run_distributed(_train, 4, shrunk_qwen3_moe_line(str(tmp_path / "ckpt"), iters=2)) if r)
    assert [i for i, _ in losses] == [1, 2] and all(0 < loss < 20 for _, loss in losses), losses


def test_cli_validates_the_mixtral_line(tmp_path):
    cmd = [sys.executable, "-m", "megazero.train", "--validate-only", "--config-only", "--world-size", "4",
           *shrunk_mixtral_line(str(tmp_path / "ckpt"))]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith("error")]
