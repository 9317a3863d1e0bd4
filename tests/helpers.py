"""The one helper module of the tests (conftest.py holds only fixtures): the config and trainer
builders (megazero.harness.configs, which the benchmark scripts use too), a small corpus, the
scripts' loader, spawning N gloo ranks or the real entry point under torchrun (both through
megazero.harness.spawn), the parity assertions, and the TensorBoard reader.

Test modules import from here (`from helpers import make_trainer`) and never from one another;
the builders also run inside spawned gloo ranks, where no fixture exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megazero.data.indexed import IndexedDataset, IndexedDatasetWriter, loss_mask_prefix
from megazero.harness.configs import TINY_CONFIG, make_config
from megazero.harness.spawn import run_ranks, torchrun_command

REPO = Path(__file__).resolve().parents[1]  # the repository root

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
        p = cfg.parallel
        return Trainer(cfg, ProcessGrid.create(p.tp, p.pp, cp=p.cp, ep=p.ep, etp=p.expert_tp))


def muon_steps(args: Sequence[str], base: str | dict = TINY_CONFIG, iters: int = 3) -> bytes:
    """`iters` steps of make_trainer(args, base) in a spawned rank, counting Newton-Schulz's
    matrices: this rank's parameters (its TP shards) with their placements, the losses, the shape
    of every matrix it orthogonalised (a batch: each of its matrices), its TP rank and size and
    the model config; sent by value (read with `loaded`)."""
    import torch

    import megazero.zero.muon as muon
    from megazero.parallel.placement import placement
    calls: list[tuple[int, ...]] = []
    plain = muon.orthogonalize

    def counted(u: torch.Tensor, steps: int) -> torch.Tensor:
        calls.extend([tuple(u.shape[-2:])] * (u.shape[0] if u.dim() == 3 else 1))
        return plain(u, steps)
    muon.orthogonalize = counted
    try:
        tr = make_trainer(args, base)
        losses = [tr.train_step()["loss"] for _ in range(iters)]
    finally:
        muon.orthogonalize = plain
    where = {name: placement(p) for chunk in tr.chunks for name, p in chunk.named_parameters()}
    buf = io.BytesIO()
    torch.save({"params": tr.optimizer.sharded.full_state_dict(), "where": where, "losses": losses, "calls": calls,
                "tp": tr.grid.tp, "tp_rank": tr.grid.tp_rank, "ep": tr.grid.ep, "ep_rank": tr.grid.ep_rank,
                "model": tr.cfg.model}, buf)
    return buf.getvalue()


def loaded(results: list[bytes]) -> list[Any]:
    """Each rank's result sent by value (torch.save'd bytes), loaded."""
    import torch
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def warm_trainer_and_plan(args: Sequence[str], base: str | dict):
    """make_trainer(args, base) after one warm-up step, its comm counters reset (the next step is
    a steady one to measure), and the layout planner's prediction for this rank's pipeline stage."""
    import torch.distributed as dist

    from megazero.plan.planner import Cluster, predict, run_layout
    cfg, tr = make_config(args, base, world=dist.get_world_size()), make_trainer(args, base)
    tr.train_step()
    tr.grid.reset_counters()
    pred = predict(cfg, run_layout(cfg, tr.grid.dp, cfg.parallel.cp), Cluster(dist.get_world_size(), 8, 1.0, None),
                   ranks=[tr.grid.pp_rank], device="cpu")
    return tr, pred.rank(tr.grid.pp_rank)


def make_grid(tp: int):
    """This spawned rank's grid of tp x dp (pp 1) on the gloo world it joined, for tests of
    single layers (a trainer builds its own)."""
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    grid = ProcessGrid(tp=tp, pp=1, dp=dist.get_world_size() // tp, rank=dist.get_rank())
    grid.build_groups()
    return grid


def full_logits(trainer, rows):
    """A trainer's model's logits of token ids `rows` in eval mode ([b, s, vocab], unpadded): ZeRO-3
    gathers as it runs, the TP vocabulary slices are joined (one pipeline stage)."""
    import torch
    import torch.distributed as dist

    model, tp = trainer.chunks[0], trainer.grid.tp_group
    with torch.no_grad():
        local = model.eval()(rows)
    model.train()
    if tp.size == 1:  # a solo group has no process group to gather over
        return local[..., : trainer.cfg.model.vocab_size]
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(pieces, local, group=tp.pg)
    return torch.cat(pieces, dim=-1)[..., : trainer.cfg.model.vocab_size]


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


HF_TINY_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=320, n_positions=48)


def hf_tiny_gpt2_args(steps: int, optim: list[str]) -> list[str]:
    """megazero's flags for the model of HF_TINY_GPT2 (no dropout, vocabulary from the checkpoint)
    on mock data, 8 sequences of 32 tokens a step for `steps` steps, with the optimizer's flags
    `optim`, weight decay 0.1 and small ZeRO buckets and sub-groups."""
    h = HF_TINY_GPT2
    return ["--model.num_layers", str(h["n_layer"]), "--model.hidden_size", str(h["n_embd"]), "--model.num_heads",
            str(h["n_head"]), "--model.seq_length", "32", "--model.vocab_size", "auto", "--model.dropout", "0",
            "--data.mock", "true", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
            "--train.iters", str(steps), *optim, "--optim.weight_decay", "0.1", "--zero.sub_group_size", "5000",
            "--zero.bucket_size", "20000"]


def save_random_hf(path: Path, family: str = "gpt2", shard_size: Optional[str] = None, **config) -> str:
    """A random Hugging Face GPT-2 (no dropout), Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE or
    OLMoE (`family`: the model_type; `config`: its Config's sizes) with non-trivial norms and
    biases, saved as safetensors under `path` (for checkpoint.init_from_hf); `shard_size` saves
    shards with an index."""
    import torch
    import transformers
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config, resid_pdrop=0, embd_pdrop=0,
                                                                     attn_pdrop=0))
    else:
        auto = transformers.AutoConfig.for_model(family, **config)
        model = transformers.AutoModelForCausalLM.from_config(auto)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(str(path), safe_serialization=True,
                          **({"max_shard_size": shard_size} if shard_size else {}))
    return str(path)


def hf_adamw(params: list, o, lr: float):
    """torch.optim.AdamW as megazero steps these parameters: weight decay on matrices, none on
    1-D parameters (`o`: the run's optim section)."""
    import torch
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": o.weight_decay},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=lr, betas=(o.beta1, o.beta2), eps=o.eps)


def hf_reference_losses(model, steps: int, vocab: int, seed: int, clip: float, step: Callable[[int], None],
                        batch: int = 8, seq: int = 32) -> list[float]:
    """A transformers model trained on megazero's mock global batches (sample i depends only on
    (seed, i)): each step's loss, after the backward, one global-norm clip of every gradient
    and `step(i)`, the reference optimizers' update."""
    import torch

    from megazero.data.mock import MockGPTDataset
    ds = MockGPTDataset(batch * steps, seq, vocab, seed)
    out = []
    for i in range(steps):
        rows = torch.stack([torch.as_tensor(ds[k]) for k in range(batch * i, batch * (i + 1))]).long()
        model.zero_grad()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        step(i)
        out.append(loss.item())
    return out


def momentum_checkpoints(args: list[str], root: str, between: Optional[Callable[[str], dict]] = None) -> dict:
    """In each spawned rank, for an optimizer whose momentum lives in the exp_avg slot (Muon,
    SGD): `args` with 2 steps, a save to root/save, 2 steps; a resume of the save; `between(root)`'s
    entries; the refusal of an AdamW resume and an AdamW start from its weights with
    checkpoint.load_optimizer false. What assert_momentum_checkpoints() checks."""
    import torch

    from megazero.checkpoint.base import CheckpointError
    save = args + ["--train.iters", "4", "--checkpoint.save", f"{root}/save"]
    tr = make_trainer(save)
    [tr.train_step() for _ in range(2)]
    tr.checkpoints.save(tr.iteration, last=False)
    buffers = tr.optimizer.state.read("exp_avg").clone()
    out = {"straight": [tr.train_step()["loss"] for _ in range(2)],
           "params": tr.optimizer.sharded.full_state_dict(), "momentum_norm": float(buffers.norm())}
    resumed = make_trainer(save + ["--checkpoint.load", f"{root}/save"])
    out["buffers_equal"] = torch.equal(resumed.optimizer.state.read("exp_avg"), buffers)
    out["resumed"] = [resumed.train_step()["loss"] for _ in range(2)]
    out["resumed_params"] = resumed.optimizer.sharded.full_state_dict()
    out.update(between(root) if between is not None else {})
    adamw = [*args, "--train.iters", "4", "--optim.name", "adamw", "--checkpoint.load", f"{root}/save"]
    try:
        make_trainer(adamw)
    except CheckpointError as e:
        out["refused"] = str(e)
    out["fresh"] = make_trainer(adamw + ["--checkpoint.load_optimizer", "false"]).train_step()["loss"]
    return out


def assert_momentum_checkpoints(out: dict, name: str) -> None:
    """momentum_checkpoints(): the buffer saved and resumed bitwise, the AdamW resume refused in one
    line naming `name`'s state and the option, the AdamW start's first loss the straight run's."""
    import torch
    assert out["momentum_norm"] > 0 and out["buffers_equal"]
    assert out["resumed"] == out["straight"]  # bitwise
    for key, p in out["params"].items():
        assert torch.equal(p, out["resumed_params"][key]), key
    assert out["refused"].count("\n") == 0 and f"holds {name} optimizer state" in out["refused"]
    assert "checkpoint.load_optimizer false" in out["refused"]
    assert out["fresh"] == out["straight"][0]  # the same weights and batch: a fresh AdamW's first loss, bitwise


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


# ----------------------------------------------------------------------------- ranks


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 240) -> list[Any]:
    """Run fn(*args) on `world_size` spawned gloo ranks (one thread each); return the results in
    rank order. `fn` must be a module-level function (it is pickled into the children)."""
    return run_ranks(fn, world_size, *args, timeout=timeout)


def torchrun(nproc: int, args: list[str], cwd: str, timeout: float = 300,
             restarts: Optional[int] = None) -> subprocess.CompletedProcess:
    """Run `python -m megazero.train ARGS` under torchrun with `nproc` CPU processes (and
    --max-restarts `restarts` when given)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(torchrun_command(nproc, args, restarts), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_records(tmp_path, nproc: int, args: list[str], name: str) -> list[dict]:
    """Run megazero.train under torchrun with ARGS, assert it succeeded, return its JSONL records."""
    out = str(tmp_path / f"{name}.jsonl")
    root = str(REPO)
    proc = torchrun(nproc, args + ["--logging.jsonl", out], cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(out)


def logged_by_layout(records: Callable[[list[str]], list], layouts: dict[str, list[str]]) -> dict[str, list]:
    """In a spawned rank: train each layout (`records(extra args)`, which returns its records on
    the logging rank and nothing elsewhere) in this one world; the logging rank's records of each."""
    import torch.distributed as dist
    out = {}
    for name, extra in layouts.items():
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records(extra))
        out[name] = next(r for r in everyone if r)
    return out


def losses_saving_at_2(trainer: Any, iters: int) -> list[float]:
    """In a spawned rank: train `iters` steps, saving a checkpoint after the second; their losses."""
    losses = []
    for i in range(iters):
        losses.append(trainer.train_step()["loss"])
        if i == 1:
            trainer.checkpoints.save(trainer.iteration, last=False)
    return losses


def moe_save_then_resume(root: str, args: list[str], layout: list[str], resumes: dict[str, list[str]],
                         iters: int) -> dict:
    """In spawned ranks: train configs/mixtral-tiny.yaml with `args` at `layout` `iters` steps,
    saving after 2 (with its 16-bit model); its universal and torch exports; each of `resumes`
    (`args` and a layout, loading the save or, with "universal" in its name, the universal export)
    trains the rest. The losses and the full parameters each resume starts from on the logging rank, the
    torch export's and the 16-bit model's on rank 0 (empty elsewhere)."""
    import contextlib
    import io

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megazero.convert import main as convert_main
    save, universal, exported = f"{root}/save", f"{root}/universal", f"{root}/model.pt"
    t = make_trainer(args + layout + ["--checkpoint.save", save, "--checkpoint.save_model_16bit", "true"],
                     base="configs/mixtral-tiny.yaml")
    out: dict = {"straight": losses_saving_at_2(t, iters)}
    if dist.get_rank() == 0:
        with contextlib.redirect_stdout(io.StringIO()):
            convert_main(["--load", save, "--to", "universal", "--output", universal])
            convert_main(["--load", save, "--to", "torch", "--output", exported])
        out["exported"] = torch.load(exported, weights_only=True)
        out["16bit"] = load_file(f"{save}/iter_0000002/model_16bit.safetensors")
    dist.barrier()
    for name, extra in resumes.items():
        t = make_trainer(args + extra + ["--checkpoint.load", universal if "universal" in name else save],
                         base="configs/mixtral-tiny.yaml")
        out[f"{name}-start"] = t.optimizer.sharded.full_state_dict()
        out[name] = [t.train_step()["loss"] for _ in range(iters - 2)]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out if t.is_logger else None)
    if dist.get_rank() != 0:
        return {}
    logged = next(o for o in everyone if o)  # the losses of the logging rank, rank 0's export
    return {**logged, "exported": out["exported"], "16bit": out["16bit"]}


def assert_moe_resumes(out: dict, reference: list, same: str, resharded: list[str]) -> None:
    """Of `moe_save_then_resume`: the uninterrupted run equals the single process; the same
    layout's resume is bitwise, the resharded ones within 1e-5; the first resharded one (at ep 1,
    tp 1: every expert whole) starts from what the torch export holds, and the 16-bit model
    saved during training holds them too (in bf16)."""
    import torch
    losses = [r[0] for r in reference]
    assert max(abs(a - b) for a, b in zip(out["straight"], losses, strict=True)) <= 1e-5
    assert out[same] == out["straight"][2:], (out[same], out["straight"])
    for name in resharded:
        assert max(abs(a - b) for a, b in zip(out[name], losses[2:], strict=True)) <= 1e-5, (name, out[name])
    whole = out[f"{resharded[0]}-start"]
    experts = [n for n in whole if ".experts." in n]
    assert experts and all(out["exported"][n].shape == value.shape for n, value in whole.items())
    for name, value in whole.items():
        assert torch.equal(out["exported"][name], value), name
    assert set(experts) <= set(out["16bit"])
    for name, value in out["16bit"].items():
        assert torch.equal(value, out["exported"][name].to(value.dtype)), name


def check_moe_buckets(tr) -> None:
    """In a spawned rank, of a trainer of an MoE model: expert weights in buckets of their own over
    expert-dp, dense ones over dp x cp, as the planner lays them out (plan/ranks.py: the same
    buckets, each expert E / ep and 1 / etp wide, padded for their own group)."""
    from megazero.plan.ranks import rank_params
    from megazero.zero.partition import bucket_numel
    sharded, grid, cfg = tr.optimizer.sharded, tr.grid, tr.cfg
    for b in sharded.layout.buckets:
        expert = "experts." in b.slots[0].name
        group = grid.expert_dp_group if expert else grid.dp_cp_group
        assert b.group == ("expert_dp" if expert else "dp_cp") and all(("experts." in s.name) == expert for s in b.slots)
        assert (b.shards, b.rank) == sharded.sharding.shards(group)
    p = cfg.parallel
    planned = rank_params(cfg.model, p.tp, p.pp, p.vpp, grid.pp_rank, sharded.sharding.parameters, cfg.zero.bucket_size,
                          p.pp_layers, grid.ep, grid.etp).split_experts()[2]
    shards = sharded.sharding.shards(grid.expert_dp_group)[0]
    assert [b.numel for b in sharded.layout.buckets if b.group == "expert_dp"] == \
        [bucket_numel(list(b), shards) for b in planned]


MOE_ITERS = 3
MOE_SHORT = ["--train.iters", str(MOE_ITERS), "--model.seq_length", "32", "--train.global_batch_size", "8",
             "--train.micro_batch_size", "2", "--model.moe_aux_loss_coeff", "0.1", "--model.moe_z_loss_coeff", "0.01"]
"""The MoE parity tests' short run of configs/mixtral-tiny.yaml; large loss coefficients, so that the
aux and z-losses' gradients weigh in the gradient norm."""


def zero(stage: int) -> list[str]:
    return ["--zero.stage", str(stage)]


def moe_records(args: Sequence[str], check: Optional[Callable[[Any], None]] = None) -> list[tuple[float, ...]]:
    """In a spawned rank: train configs/mixtral-tiny.yaml with `args` (after `check(trainer)`, when
    given); (loss, grad norm, aux loss, z-loss) of each iteration on the logging rank, nothing elsewhere."""
    tr = make_trainer(args, base="configs/mixtral-tiny.yaml")
    if check is not None:
        check(tr)
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    return [(r["loss"], r["grad_norm"], r["moe_aux_loss"], r["moe_z_loss"]) for r in records] if tr.is_logger else []


def logged_losses(make: Callable[[], Any]) -> list[tuple[float, float]]:
    """In a spawned rank: run the trainer `make()` builds; (loss, grad norm) of each iteration
    on the logging rank, nothing elsewhere."""
    import contextlib
    import io
    tr = make()
    with contextlib.redirect_stdout(io.StringIO()):
        records = tr.run()
    return [(r["loss"], r["grad_norm"]) for r in records] if tr.is_logger else []


def assert_parity(runs: dict[str, list], reference: list, iters: int, tol: float = 1e-5) -> None:
    """Every layout's per-iteration (loss, grad norm, ...) within `tol` of the single process's."""
    for name, run in runs.items():
        assert len(run) == len(reference) == iters, name
        diffs = [max(abs(a - b) for a, b in zip(r, ref, strict=True)) for r, ref in zip(run, reference, strict=True)]
        print(f"{name}: max |delta loss, grad norm| vs single process {max(diffs):.2e}")  # pytest -s
        assert max(diffs) <= tol, (name, run, reference)


# ----------------------------------------------------------------------------- TensorBoard

# TensorBoard tag -> (JSONL field, unit, also "TAG vs samples"), written out here as the spec:
# Megatron-LM's tags (training.py training_log / evaluate_and_print_results), then megazero's.
TAGS = {
    "lm loss": ("loss", 1, True),
    "learning-rate": ("lr", 1, True),
    "batch-size": ("batch_size", 1, True),
    "loss-scale": ("loss_scale", 1, True),
    "grad-norm": ("grad_norm", 1, True),
    "lm loss validation": ("val_loss", 1, True),
    "lm loss validation ppl": ("val_ppl", 1, True),
    "iteration-time": ("iteration_time_s", 1, False),
    "throughput": ("tflops_per_device", 1, False),
    "mem-max-allocated-bytes": ("peak_mem_gib", 2**30, False),
    "tokens-per-sec": ("tokens_per_sec", 1, False),
    "mfu": ("mfu", 1, False),
    "skipped-iterations": ("skipped_iters", 1, False),
    "load_balancing_loss": ("moe_aux_loss", 1, True),
    "z_loss": ("moe_z_loss", 1, True),
    "moe-imbalance": ("moe_imbalance", 1, False),
    "moe-dropped-tokens": ("moe_dropped", 1, False),
}


def tensorboard_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(x: float) -> float:
    return float(np.float32(x))  # TensorBoard stores scalars as float32


def assert_tensorboard_matches(log_dir: str, records: list[dict]) -> None:
    """Every scalar in log_dir (by iteration) and log_dir/vs_samples (by consumed samples) is
    a JSONL value under its tag, and every JSONL value with a tag is there, once."""
    from megazero.train.sinks import SAMPLES_RUN
    expected: dict[str, list[tuple[int, float]]] = {}
    samples: dict[str, list[tuple[int, float]]] = {}
    for tag, (field, unit, vs_samples) in TAGS.items():
        rows = [r for r in records if r.get(field) is not None]
        if rows:
            expected[tag] = [(r["iteration"], _f32(r[field] * unit)) for r in rows]
            if vs_samples:
                samples[f"{tag} vs samples"] = [(r["consumed_samples"], _f32(r[field] * unit)) for r in rows]
    from megazero.train.sinks import PER_LAYER, PER_RANK
    for field, tag in PER_LAYER.items():  # logging.moe_per_layer: one tag per MoE layer, by iteration
        for r in records:
            for i, value in (r.get(field) or {}).items():
                expected.setdefault(f"{tag}/layer_{i}", []).append((r["iteration"], _f32(value)))
    for field, tag in PER_RANK.items():  # the straggler watch: one tag per phase and rank, by iteration
        for r in records:
            for phase, values in (r.get(field) or {}).items():
                for rank, value in enumerate(values):
                    expected.setdefault(f"{tag}/{phase}/rank_{rank}", []).append((r["iteration"], _f32(value)))
    for r in records:  # a stream's tokens per source, by iteration and by samples
        for source, tokens in (r.get("stream_tokens") or {}).items():
            expected.setdefault(f"stream_tokens/{source}", []).append((r["iteration"], _f32(tokens)))
            samples.setdefault(f"stream_tokens/{source} vs samples", []).append((r["consumed_samples"], _f32(tokens)))
    assert tensorboard_scalars(log_dir) == expected
    assert tensorboard_scalars(os.path.join(log_dir, SAMPLES_RUN)) == samples
