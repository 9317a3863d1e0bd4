"""DeepSpeed checkpoints in: a Hugging Face GPT-2 trained by the real `deepspeed` package (CPU,
gloo, dp 2) continues in megazero at tp 2 x pp 2 with DeepSpeed's next losses, and converts.

The DeepSpeed run feeds the batches megazero's data loader would (mock samples by index, each
DP rank its slice of every global batch) and computes megazero's loss (mean over the global
batch's tokens), so the two runs can be compared step for step."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import make_trainer, run_distributed
from megazero.checkpoint.base import CheckpointError
from megazero.checkpoint.hf import from_hf
from megazero.checkpoint.hf_names import HEAD
from megazero.checkpoint.load import open_checkpoint
from megazero.checkpoint.tensors import fit_vocab
from megazero.parallel.placement import placement

MICRO, DP, SAVED_AT, SEED = 4, 2, 3, 1234
MODEL = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "seq_length": 64, "vocab_size": 512}
DS_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                            "torch_adam": True}}  # torch's AdamW: no C++ op to build
# DeepSpeed's WarmupLR sets step k's LR from k - 1 (step 0 at warmup_min_lr), megazero's linear warm-up
# from k + 1: after two warm-up steps (DeepSpeed's least) both are at warmup_max_lr from step 3 on.
DS_SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                               "warmup_type": "linear"}}


def train_deepspeed(out: str, stage: int, precision: str, steps_after: int, hf_config: bool = True) -> list[float]:
    """In each of DP spawned gloo ranks: SAVED_AT DeepSpeed steps, a save to `out` (with the
    GPT-2's config.json beside it when `hf_config`, as HF's Trainer saves), then `steps_after`
    more; every step's loss (before its update), as megazero computes it."""
    import deepspeed
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    from megazero.data.gpt_dataset import inputs_and_labels
    from megazero.data.mock import MockGPTDataset
    deepspeed.init_distributed(dist_backend="gloo")  # joins the group the spawn helper made
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    hf = GPT2Config(vocab_size=MODEL["vocab_size"], n_positions=MODEL["seq_length"], n_embd=MODEL["hidden_size"],
                    n_layer=MODEL["num_layers"], n_head=MODEL["num_heads"], resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(hf)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": DS_OPTIMIZER, "scheduler": DS_SCHEDULER, "zero_optimization": {"stage": stage},
              "steps_per_print": 10_000}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    # Two parameter groups, as the Hugging Face Trainer makes them (and as megazero decays): 1-D
    # parameters (biases, LayerNorm) without weight decay.
    groups = [{"params": [p for p in model.parameters() if p.ndim >= 2]},
              {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    data = MockGPTDataset(10_000, MODEL["seq_length"], MODEL["vocab_size"], SEED)
    losses = []
    for step in range(SAVED_AT + steps_after):
        first = step * MICRO * DP + rank * MICRO  # megazero's order: DP rank r takes the r-th micro-batch
        inputs, labels = (torch.from_numpy(a) for a in inputs_and_labels([data[first + k] for k in range(MICRO)]))
        logits = engine(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / DP)
        engine.backward(loss)
        engine.step()
        if step == SAVED_AT - 1:
            engine.save_checkpoint(out)
    if rank == 0 and hf_config:
        model.config.save_pretrained(out)  # DeepSpeed does not record the model's shape; HF's Trainer saves this
    return losses


def continue_in_megazero(ds_dir: str, iters: int) -> dict:
    """In each of 4 spawned ranks: resume `ds_dir` at tp 2 x pp 2 and train to `iters`; the
    position resumed at, this rank's TP shards of the weights it resumed with, the log records."""
    args = [f"--model.{k}={v}" for k, v in MODEL.items()] + [
        "--parallel.tp=2", "--parallel.pp=2", f"--checkpoint.load={ds_dir}",
        f"--train.iters={iters}", f"--train.micro_batch_size={MICRO}", f"--train.global_batch_size={MICRO * DP}",
        f"--train.seed={SEED}", "--optim.lr=1e-3", "--optim.min_lr=0", "--optim.warmup_iters=2",
        "--optim.decay_style=constant", "--optim.weight_decay=0.1", "--optim.beta2=0.95", "--optim.clip_grad=1.0"]
    trainer = make_trainer(args)
    resumed = {"iteration": trainer.iteration, "schedule_steps": trainer.schedule.steps,
               "adam_step": trainer.optimizer.step_count}
    tp = (trainer.grid.tp_rank, trainer.grid.tp)
    weights = {n: (t.clone(), placement(p), *tp)
               for n, p, t in trainer.optimizer.sharded.full_parameters()}  # collective at stage 3: all ranks
    return {**resumed, "weights": weights, "records": trainer.run()}


def _deepspeed_run(tmp_path, stage: int, precision: str = "fp32", steps_after: int = 2, hf_config: bool = True):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = str(tmp_path / f"ds_zero{stage}_{precision}")
    losses = run_distributed(train_deepspeed, DP, out, stage, precision, steps_after, hf_config, timeout=600)[0]
    return out, losses


def _check_continuation(ds_dir: str, losses: list[float]) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    iters = len(losses)
    results = run_distributed(continue_in_megazero, 4, ds_dir, iters, timeout=600)
    assert {(r["iteration"], r["schedule_steps"], r["adam_step"]) for r in results} == {(SAVED_AT,) * 3}
    # Every rank's shards equal DeepSpeed's fp32 master weights exactly (as DeepSpeed's own tool reads them).
    theirs = get_fp32_state_dict_from_zero_checkpoint(ds_dir)
    for r in results:
        for name, (value, where, tp_rank, tp) in r["weights"].items():
            expected = fit_vocab(name, from_hf(name, theirs["transformer.wte.weight" if name == HEAD else name]),
                                 where.full_shape)
            assert torch.equal(value, where.shard(expected.float(), tp_rank, tp)), name
    # The first megazero loss is DeepSpeed's next-step loss on the same batch; the next ones
    # follow from the carried-over Adam moments, step count and LR position.
    records = next(r["records"] for r in results if r["records"] and r["records"][0]["loss"] is not None)
    assert [r["iteration"] for r in records] == list(range(SAVED_AT + 1, iters + 1))
    assert [r["loss"] for r in records] == pytest.approx(losses[SAVED_AT:], abs=1e-4)


def _check_conversions(tmp_path, ds_dir: str) -> None:
    """convert --to hf / torch / universal: the same weights (and, universal, the same state)."""
    from megazero.convert import main as convert
    source = open_checkpoint(ds_dir)
    weights = dict(source.tensors())
    for to, out in (("hf", tmp_path / "hf"), ("torch", tmp_path / "model.pt"), ("universal", tmp_path / "universal")):
        convert(["--load", ds_dir, "--to", to, "--output", str(out)])
        converted = open_checkpoint(str(out))
        assert all(torch.equal(t, weights[n]) for n, t in converted.tensors()), to
    universal = open_checkpoint(str(tmp_path / "universal"))
    assert universal.trainer_state() == source.trainer_state()
    assert all(torch.equal(t, dict(source.tensors("exp_avg"))[n]) for n, t in universal.tensors("exp_avg"))


@pytest.mark.slow  # ~70 s (DeepSpeed at dp 2, then megazero on 4 ranks); the reader's fast tests run by default
def test_deepspeed_zero3_continues_in_megazero_at_tp2_pp2(tmp_path):
    ds_dir, losses = _deepspeed_run(tmp_path, stage=3, steps_after=1)
    _check_continuation(ds_dir, losses)
    _check_conversions(tmp_path, ds_dir)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero12_continues_in_megazero_at_tp2_pp2(tmp_path, stage):
    ds_dir, losses = _deepspeed_run(tmp_path, stage=stage)
    _check_continuation(ds_dir, losses)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_without_config_json_continues_and_converts_with_the_runs_model(tmp_path, stage):
    """A plain engine.save_checkpoint(DIR): no config.json anywhere. megazero resumes it with the
    run's model section (continue_in_megazero states it) with DeepSpeed's next losses, and
    convert, given the model section (--config FILE, --model.KEY VALUE), writes exactly the
    weights DeepSpeed's zero_to_fp32 reads."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from megazero.convert import main as convert
    ds_dir, losses = _deepspeed_run(tmp_path, stage=stage, steps_after=1, hf_config=False)
    assert not glob.glob(os.path.join(ds_dir, "**", "config.json"), recursive=True)
    _check_continuation(ds_dir, losses)
    theirs = get_fp32_state_dict_from_zero_checkpoint(ds_dir)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"model": MODEL}))
    convert(["--load", ds_dir, "--to", "torch", "--output", str(tmp_path / "model.pt"),
             *(f"--model.{k}={v}" for k, v in MODEL.items())])
    convert(["--load", ds_dir, "--to", "hf", "--output", str(tmp_path / "hf"), "--config", str(tmp_path / "run.yaml")])
    exported = dict(open_checkpoint(str(tmp_path / "model.pt")).tensors())
    assert exported.keys() == theirs.keys() - {HEAD}
    assert all(torch.equal(t, from_hf(n, theirs[n])) for n, t in exported.items())
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert hf.keys() == theirs.keys() - {HEAD} and all(torch.equal(t, theirs[n]) for n, t in hf.items())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_checkpoints_and_universal_folders_read_as_deepspeed_does(tmp_path, stage):
    """bf16 training keeps fp32 masters in the optimizer files: they are what is read, equal to
    DeepSpeed's own reconstruction; its universal folder reads the same tensors and state."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    ds_dir, _ = _deepspeed_run(tmp_path, stage=stage, precision="bf16", steps_after=0)
    theirs = get_fp32_state_dict_from_zero_checkpoint(ds_dir)
    ckpt = open_checkpoint(ds_dir)
    assert all(torch.equal(t, from_hf(n, theirs[n].float())) for n, t in ckpt.tensors())
    universal = os.path.join(ds_dir, f"global_step{SAVED_AT}_universal")
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           os.path.join(ds_dir, f"global_step{SAVED_AT}"), "--output_folder", universal,
                           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert open_checkpoint(ds_dir).kind == "DeepSpeed checkpoint"  # `latest` wins over `latest_universal` beside it
    via_universal = open_checkpoint(universal)
    assert via_universal.kind == "DeepSpeed universal checkpoint"
    assert via_universal.trainer_state() == ckpt.trainer_state()
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        mine = dict(ckpt.tensors(kind))
        assert all(torch.equal(t, mine[n]) for n, t in via_universal.tensors(kind)), kind


def test_a_file_needing_other_types_is_refused_without_running_it(tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (print, ("code from the checkpoint ran",))

    folder = tmp_path / "global_step1"
    folder.mkdir()
    torch.save({"module": {}, "global_steps": 1, "extra": Payload()}, folder / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(str(tmp_path))
    assert str(err.value) == (f"{folder / 'mp_rank_00_model_states.pt'} needs the type print to load, which is "
                              f"not one of the DeepSpeed types megazero reads; refused (loading it would run code "
                              f"from the file)")
    assert "ran" not in capsys.readouterr().out


def test_a_deepspeed_checkpoint_without_the_models_config_names_the_fix(tmp_path):
    folder = tmp_path / "global_step1"
    folder.mkdir()
    torch.save({"module": {}, "param_shapes": [{}], "global_steps": 1, "dp_world_size": 1},
               folder / "mp_rank_00_model_states.pt")
    torch.save({}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(CheckpointError, match=r"has no config.json beside it .*model.config.save_pretrained\(DIR\)"):
        open_checkpoint(str(tmp_path))


def _shapes_only_checkpoint(tmp_path) -> str:
    """A DeepSpeed ZeRO-2 folder of MODEL's GPT-2 without config.json: its param_shapes (HF's
    names and Conv1D layout, as transformers makes them) and no values (none are read here)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config(n_layer=MODEL["num_layers"], n_embd=MODEL["hidden_size"],
                                        n_head=MODEL["num_heads"], n_positions=MODEL["seq_length"],
                                        vocab_size=MODEL["vocab_size"], bos_token_id=0, eos_token_id=0))
    folder = tmp_path / "global_step1"
    folder.mkdir()
    torch.save({"module": {}, "param_shapes": [{n: p.shape for n, p in hf.named_parameters()}], "global_steps": 1,
                "dp_world_size": 1}, folder / "mp_rank_00_model_states.pt")
    torch.save({}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    return str(tmp_path)


def test_without_config_json_every_recorded_shape_is_checked_against_the_runs_model(tmp_path, capsys):
    """The run's model section is the checkpoint's model once every recorded shape is its (the
    heads and LayerNorm's epsilon from the run, vocab_size auto from the embedding); a mismatch
    is one line naming the parameter, both shapes, and what the shapes say."""
    from megazero.config import build_config
    from megazero.convert import main as convert
    pytest.importorskip("transformers")
    ds_dir = _shapes_only_checkpoint(tmp_path)
    run = build_config({"model": {**MODEL, "num_heads": 8, "vocab_size": "auto", "layernorm_eps": 1e-6}})
    ckpt = open_checkpoint(ds_dir, stated=run)
    m = ckpt.model_config
    assert (m.num_heads, m.vocab_size, m.layernorm_eps, m.hidden_size) == (8, MODEL["vocab_size"], 1e-6, 64)
    assert ckpt.training.config.model == m
    folder = os.path.join(ds_dir, "global_step1")
    for change, line in (
            ({"hidden_size": 32}, "transformer.wte.weight has shape [512, 64] there but [512, 32] in the run's model "
                                  "section; its shapes say --model.hidden_size 64"),
            ({"num_layers": 3}, "transformer.h.3.ln_1.weight has shape [64] there but (none) in the run's model "
                                "section; its shapes say --model.num_layers 4"),
            ({"ffn_hidden_size": 128}, "transformer.h.0.mlp.c_fc.weight has shape [64, 256] there but [64, 128] in "
                                       "the run's model section; its shapes say --model.ffn_hidden_size 256")):
        with pytest.raises(CheckpointError) as err:
            open_checkpoint(ds_dir, stated=build_config({"model": {**MODEL, **change}}))
        assert str(err.value) == f"DeepSpeed checkpoint '{folder}' does not hold this run's model: {line}"
    # convert: without the model section, the error names both fixes; with a wrong one, the line above.
    for args, wanted in (((), "state the model section (convert --config FILE or --model.KEY VALUE), or save "
                              "config.json there with model.config.save_pretrained(DIR)"),
                         (("--model.num_heads", "5"), "error: model.num_heads (5) must divide model.hidden_size "
                                                      "(64)")):
        with pytest.raises(SystemExit) as e:
            convert(["--load", ds_dir, "--to", "torch", "--output", str(tmp_path / "out.pt"),
                     *(f"--model.{k}={v}" for k, v in MODEL.items() if args), *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and wanted in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.pt").exists()


def test_a_checkpoint_saved_without_zero_is_refused_with_the_fix(tmp_path):
    folder = tmp_path / "global_step1"
    folder.mkdir()
    torch.save({"module": {}, "optimizer": {"state": {}}, "param_shapes": [{}], "global_steps": 1,
                "dp_world_size": 1}, folder / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step1")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, '
                                          '"n_positions": 8, "vocab_size": 16}')
    with pytest.raises(CheckpointError, match=r"saved without ZeRO \(stage 0\); ZeRO stages 1, 2 and 3 are read"):
        open_checkpoint(str(tmp_path))


def test_deepspeeds_own_types_read_through_the_allow_list(tmp_path):
    """A ZeRO-2 file written with DeepSpeed's real DynamicLossScaler (fp16, dtype attribute and
    all), ZeroStageEnum and fragment_address, without training: each is read into its stand-in,
    and the dynamic loss scale becomes megazero's (scale, clean steps since the last change,
    hysteresis left)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from megazero.checkpoint.deepspeed import DeepSpeedReader
    scaler = DynamicLossScaler(2.0 ** 12, 100, 1, 2, False)
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 1024.0, 250, 120, 1
    folder = tmp_path / "global_step7"
    folder.mkdir()
    torch.save({"module": {}, "param_shapes": [{"wte.weight": torch.Size([16, 8])}], "global_steps": 7,
                "global_samples": 56, "skipped_steps": 2, "dp_world_size": 1, "lr_scheduler": {},
                "ds_config": {"fp16": {"enabled": True}}}, folder / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {
        "loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients, "single_partition_of_fp32_groups": [
            torch.arange(128.0)], "param_slice_mappings": [{"wte.weight": fragment_address(numel=128, start=0)}],
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(128)}}}}},
        folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, '
                                          '"n_positions": 8, "vocab_size": 16}')
    reader = DeepSpeedReader(str(folder))
    assert reader.trainer_state() == {
        "iteration": 7, "consumed_samples": 56, "skipped_iters": 2, "step": 5, "lr_schedule": None,
        "loss_scaler": {"scale": 1024.0, "clean_steps": 29, "hysteresis_left": 1}}  # (250 - 120 - 1) % 100
    assert torch.equal(reader.full("transformer.wte.weight"), torch.arange(128.0).view(16, 8))  # a bare GPT2Model
    assert torch.equal(reader.full("lm_head.weight", "exp_avg"), torch.ones(16, 8))  # the tied head
    assert reader.config.train.precision == "fp16"
