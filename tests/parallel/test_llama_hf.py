"""The Llama family from and to Hugging Face: a run starts from a transformers-saved (sharded)
LlamaForCausalLM at tensor- and pipeline-parallel layouts, each rank reading its rows of the
q/k/v and gate/up tensors, and trains step for step as LlamaForCausalLM + torch.optim.AdamW on
the same batches; a LoRA fine-tune's adapter loads with PEFT onto the exported LlamaForCausalLM
and --merge-lora folds it in."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from helpers import SAMPLES, full_logits, make_config, make_texts, make_trainer, run_distributed, save_random_hf

transformers = pytest.importorskip("transformers")

HF = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
          tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
STEPS, LR = 3, 1e-3
BASE: dict = {"data": {"mock": True}}  # no model keys: the run takes them from config.json
ARGS = ["--model.seq_length", "32", "--data.mock", "true", "--train.global_batch_size", "8",
        "--train.micro_batch_size", "2", "--train.iters", str(STEPS), "--optim.lr", str(LR), "--optim.min_lr",
        str(LR), "--optim.decay_style", "constant", "--optim.warmup_iters", "0", "--optim.clip_grad", "0",
        "--optim.weight_decay", "0.1"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, llama3_tokenizer_dir):
    """A random LlamaForCausalLM (grouped K/V, untied, no biases) with non-trivial norms, saved as
    safetensors shards with an index, beside a Llama 3 style tokenizer.json."""
    path = tmp_path_factory.mktemp("hf-llama")
    save_random_hf(path, "llama", shard_size="100KB", **HF)
    assert (path / "model.safetensors.index.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(llama3_tokenizer_dir, name), path)
    return str(path)


def _transformers_losses(hf_dir: str) -> list[float]:
    """LlamaForCausalLM + torch.optim.AdamW (decay on matrices only, as megazero) on megazero's
    global batches (mock data; sample i depends only on (seed, i))."""
    from megazero.data.mock import MockGPTDataset
    cfg = make_config(ARGS, base=BASE)
    ds = MockGPTDataset(8 * STEPS, 32, HF["vocab_size"], cfg.train.seed)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    decay = [p for p in model.parameters() if p.dim() > 1]
    plain = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=LR, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    out = []
    for step in range(STEPS):
        rows = torch.stack([torch.as_tensor(ds[i]) for i in range(8 * step, 8 * step + 8)]).long()
        loss = model(input_ids=rows, labels=rows).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


def _losses(hf_dir: str, layouts: list[list[str]]) -> list[list[float]]:
    out = []
    for layout in layouts:
        tr = make_trainer(ARGS + layout + ["--checkpoint.init_from_hf", hf_dir], base=BASE)
        out.append([tr.train_step()["loss"] for _ in range(STEPS)])
    return out


def test_llama_from_hugging_face_trains_as_transformers(hf_dir):
    """tp 2 x pp 2 (ZeRO-1) and tp 2 x dp 2 (ZeRO-3) from the sharded HF directory: every step's
    loss equals LlamaForCausalLM + AdamW within 1e-4."""
    expected = _transformers_losses(hf_dir)
    layouts = [["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "1"],
               ["--parallel.tp", "2", "--zero.stage", "3"]]
    per_layout = list(zip(*run_distributed(_losses, 4, hf_dir, layouts), strict=True))
    for layout, losses in zip(layouts, per_layout, strict=True):
        held = [run for run in losses if run[0] is not None]  # the ranks that hold the loss
        assert held, layout
        for run in held:
            assert max(abs(a - b) for a, b in zip(run, expected, strict=True)) <= 1e-4, (layout, run, expected)


def test_set_model_keys_must_agree_with_config_json(hf_dir):
    """A model key the run sets that config.json contradicts: one line naming both values."""
    from megazero.config import ConfigError
    with pytest.raises(ConfigError, match=r"model.num_query_groups \(4\) differs from num_key_value_heads \(2\) in "):
        make_config(ARGS + ["--model.num_query_groups", "4", "--checkpoint.init_from_hf", hf_dir], base=BASE, world=1)
    cfg = make_config(ARGS + ["--checkpoint.init_from_hf", hf_dir], base=BASE, world=1)
    m = cfg.model
    assert (m.position_embedding, m.activation, m.query_groups, m.tie_embeddings, m.bias, m.rope_base) == \
        ("rope", "swiglu", 2, False, False, 500000.0)


# ----------------------------------------------------------------------------- LoRA: PEFT and --merge-lora

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ["--finetune.lora_rank", "4", "--finetune.lora_alpha", "8", "--optim.lr", "2e-2", "--optim.min_lr", "2e-2",
        "--finetune.lora_targets", *HF_TARGETS]
ROWS = torch.randint(0, HF["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _lora_then_logits(hf_dir: str, save: str) -> torch.Tensor:
    """Two LoRA steps at tp 2 from hf_dir, saved; the model's logits of ROWS."""
    t = make_trainer(ARGS + LORA + ["--parallel.tp", "2", "--train.iters", "2", "--checkpoint.init_from_hf", hf_dir,
                                    "--checkpoint.save", save], base=BASE)
    for _ in range(2):
        t.train_step()
    t.checkpoints.save(t.iteration, last=False)
    return full_logits(t, ROWS)


def test_lora_adapters_load_in_peft_on_the_export_and_merge(hf_dir, tmp_path):
    """The adapter directory of a family LoRA run (q|k|v and gate|up parts, each its own PEFT
    adapter) is PEFT's for LlamaForCausalLM: on the base export its logits are megazero's
    (1e-5, fp32), and so are those of the --merge-lora export."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from megazero.convert import main as convert
    save = str(tmp_path / "save")
    expected = run_distributed(_lora_then_logits, 2, hf_dir, save)[0]
    ckpt, adapter = os.path.join(save, "iter_0000002"), os.path.join(save, "iter_0000002", "adapter")
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert (config["target_modules"], config["fan_in_fan_out"], config["base_model_name_or_path"]) == \
        (HF_TARGETS, False, hf_dir)
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2  # layers x projections x (A, B)
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 groups x 16
    base, merged = str(tmp_path / "base"), str(tmp_path / "merged")
    convert(["--load", ckpt, "--to", "hf", "--output", base])
    convert(["--load", ckpt, "--to", "hf", "--output", merged, "--merge-lora"])
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
        assert type(plain).__name__ == "LlamaForCausalLM"
        unadapted = plain(ROWS).logits
        got = peft.PeftModel.from_pretrained(plain, adapter).eval()(ROWS).logits
        folded = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()(ROWS).logits
    assert (unadapted - expected).abs().max() > 1e-3  # the adapters matter
    assert (got - expected).abs().max() <= 1e-5
    assert (folded - expected).abs().max() <= 1e-5


def test_generate_from_the_run_uses_the_tokenizer_it_started_from(hf_dir, tmp_path, capsys):
    """A run from init_from_hf without data.tokenizer: generate takes the directory's tokenizer.json."""
    from megazero.data.tokenizer import build_tokenizer
    from megazero.generate import main as generate_main
    save = str(tmp_path / "save")
    run_distributed(_lora_then_logits, 2, hf_dir, save)
    generate_main(["--load", save, "--prompt", "the model", "--temperature", "0", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    tok = build_tokenizer(hf_dir)
    assert out.startswith("the model") and len(tok.encode(out.rstrip("\n"))) >= len(tok.encode("the model"))


# ----------------------------------------------------------------------------- exports keep their tokenizer


def _one_step_saved(hf_dir: str, save: str, extra: list[str]) -> None:
    t = make_trainer(ARGS + extra + ["--train.iters", "1", "--checkpoint.init_from_hf", hf_dir,
                                     "--checkpoint.save", save], base=BASE)
    t.train_step()
    t.checkpoints.save(t.iteration, last=False)


def test_an_export_of_a_run_from_hf_carries_that_directorys_tokenizer(hf_dir, tmp_path, capsys):
    """A run from init_from_hf without data.tokenizer, exported with convert --to hf: the export
    holds the directory's tokenizer files, so generate --load EXPORT needs no --tokenizer and
    AutoTokenizer.from_pretrained(EXPORT) encodes as megazero does (issue 46, 7)."""
    from megazero.convert import main as convert
    from megazero.data.tokenizer import build_tokenizer
    from megazero.generate import main as generate_main
    save, export = str(tmp_path / "save"), str(tmp_path / "export")
    run_distributed(_one_step_saved, 1, hf_dir, save, [])
    convert(["--load", save, "--to", "hf", "--output", export])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(export, name)).read() == open(os.path.join(hf_dir, name)).read(), name
    ours, theirs = build_tokenizer(hf_dir), transformers.AutoTokenizer.from_pretrained(export)
    for text in ("the model", "Question: what is two and two?\nAnswer: Four."):
        assert theirs(text, add_special_tokens=False).input_ids == ours.encode(text)
    assert theirs.eos_token_id == ours.eod
    capsys.readouterr()
    generate_main(["--load", export, "--prompt", "the model", "--temperature", "0", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("the model")


def test_an_export_writes_the_runs_data_tokenizer_when_it_is_another(hf_dir, tmp_path):
    """data.tokenizer other than the starting directory's (here a GPT-2 BPE of 280 ids): the
    export carries the tokenizer the run was trained with, not the directory's."""
    from megazero.convert import main as convert
    from megazero.data.tokenizer import build_tokenizer, spec_of_directory, train_gpt2bpe
    bpe_spec = train_gpt2bpe(make_texts(200) + SAMPLES, 280, tmp_path / "bpe")
    save, export = str(tmp_path / "save"), str(tmp_path / "export")
    run_distributed(_one_step_saved, 1, hf_dir, save, ["--data.tokenizer", bpe_spec])
    convert(["--load", save, "--to", "hf", "--output", export])
    assert build_tokenizer(spec_of_directory(export)).identity() == build_tokenizer(bpe_spec).identity()
    text = "the model"
    assert transformers.AutoTokenizer.from_pretrained(export).encode(text) == build_tokenizer(bpe_spec).encode(text)


@pytest.mark.slow  # suite budget
def test_a_checkpoint_of_another_hf_model_names_a_fix_that_resumes(hf_dir, tmp_path):
    """Resuming a run that started from another Llama directory: refused, and the fix the line
    names (that run's init_from_hf, not --model.KEY, which config.json would refuse) resumes."""
    import math
    import re

    from megazero.checkpoint.sharded import CheckpointError, check_model, read_metadata
    narrow = save_random_hf(tmp_path / "narrow", "llama", **{**HF, "hidden_size": 32, "intermediate_size": 48})
    save = str(tmp_path / "save")
    run_distributed(_one_step_saved, 1, narrow, save, [])
    ckpt = os.path.join(save, "iter_0000001")
    resume = ARGS + ["--checkpoint.load", save, "--checkpoint.save", save, "--train.iters", "2"]
    with pytest.raises(CheckpointError) as refused:
        check_model(read_metadata(ckpt), make_config(resume + ["--checkpoint.init_from_hf", hf_dir], base=BASE), ckpt)
    fix = re.search(r"pass (--checkpoint\.init_from_hf) (\S+), the directory", str(refused.value))
    assert fix and fix.group(2) == narrow, str(refused.value)
    assert math.isfinite(run_distributed(_resumed_step, 1, resume + list(fix.groups()))[0])


def _resumed_step(args: list[str]) -> float:
    t = make_trainer(args, base=BASE)
    assert t.iteration == 1  # resumed, not started over
    return t.train_step()["loss"]
