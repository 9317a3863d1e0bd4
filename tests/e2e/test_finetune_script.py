"""scripts/finetune_gpt.sh end to end. Short form: fine-tune a given Hugging Face GPT-2 on a
few prompt/completion pairs (preprocess with the mask, validate, train under torchrun). Long form
(slow): from nothing, through the main job, its export, the embedded question/answer pairs,
fine-tuning and a resume."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess

import pytest

from helpers import EXAMPLES, REPO, SAMPLES, make_texts
from megazero.harness.spawn import free_port

ROOT = str(REPO)


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASTER_PORT": str(free_port()), **env}
    proc = subprocess.run(["bash", "scripts/finetune_gpt.sh", "--train.log_interval", "1", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _given_hf_model(tmp_path, bpe_spec: str) -> dict:
    """The short form's environment: a given HF GPT-2 (tied embedding zeroed: all logits 0, its
    first loss exactly ln 400), a few prompt/completion pairs, one process."""
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=64, vocab_size=400))
    hf.transformer.wte.weight.data.zero_()
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES * 40))
    return {"CONFIG": "configs/gpt2-tiny.yaml", "NPROC": "1", "TP": "1", "PP": "1", "WORKERS": "1",
            "HF_DIR": str(tmp_path / "hf"), "TOKENIZER": bpe_spec, "FT_INPUT": str(tmp_path / "qa.jsonl"),
            "FT_PREFIX": str(tmp_path / "data" / "qa_prompt_completion_document"), "RUN_DIR": str(tmp_path / "ft"),
            "PRETRAIN_RUN_DIR": str(tmp_path / "absent"), "ITERS": "6", "LR": "3e-3", "WARMUP": "1"}


def test_finetunes_a_given_hf_model_on_prompt_completion_pairs(tmp_path, bpe_spec: str) -> None:
    env = _given_hf_model(tmp_path, bpe_spec)
    proc = _run(env, "--train.micro_batch_size", "2", "--train.global_batch_size", "8")
    assert "running the main job" not in proc.stdout and not (tmp_path / "absent").exists()
    assert (tmp_path / "data" / "qa_prompt_completion_document_loss_mask.bin").exists()
    losses = [r["loss"] for r in _records(tmp_path / "ft")]
    assert len(losses) == 6 and abs(losses[0] - math.log(400)) < 1e-5 and losses[-1] < losses[0] - 0.1
    # It ends saying what to do next with what it made (a full fine-tune: no adapter folder).
    latest = tmp_path / "ft" / "checkpoints" / "iter_0000006"
    assert proc.stdout.splitlines()[-1] == (f"   generate: python -m megazero.generate --load {latest} "
                                            f"--prompt 'Question: ...' --max-new-tokens 40")


def test_a_save_directory_of_ones_own_is_where_a_rerun_resumes_from(tmp_path, bpe_spec: str) -> None:
    """--checkpoint.save DIR on the command line: the fine-tune saves there and, run again,
    resumes from there instead of starting over from the export."""
    env = _given_hf_model(tmp_path, bpe_spec)
    save = tmp_path / "mine" / "ck"
    for iters in (2, 4):
        proc = _run({**env, "ITERS": str(iters)}, "--checkpoint.save", str(save), "--checkpoint.interval", "2")
        assert open(save / "latest").read() == f"iter_{iters:07d}"
        assert ("resumed from" in proc.stdout) == (iters == 4), proc.stdout
    assert [r["iteration"] for r in _records(tmp_path / "ft")] == [1, 2, 3, 4]
    assert not (tmp_path / "ft" / "checkpoints").exists()


@pytest.mark.slow
def test_main_job_export_default_pairs_finetune_and_resume(tmp_path) -> None:
    env = {"DATA_DIR": str(tmp_path / "data"), "PRETRAIN_RUN_DIR": str(tmp_path / "pre"),
           "RUN_DIR": str(tmp_path / "ft"), "PRETRAIN_ITERS": "20", "ITERS": "10"}
    proc = _run(env)
    assert "running the main job first" in proc.stdout and "exporting" in proc.stdout
    assert (tmp_path / "ft" / "init_hf_iter_0000020" / "model.safetensors").exists()
    first = _records(tmp_path / "ft")
    assert [r["iteration"] for r in first] == list(range(1, 11)) and first[-1]["loss"] < first[0]["loss"]
    # Starting from the main job: the answers are already far likelier than under a random model.
    assert first[0]["loss"] < math.log(8192) - 1
    proc = _run({**env, "ITERS": "12"})
    assert "resumed from" in proc.stdout and "running the main job" not in proc.stdout
    assert _records(tmp_path / "ft")[-1]["iteration"] == 12


def test_model_llama_fine_tunes_a_hf_llama_with_lora_under_zero3(tmp_path, bpe_spec: str) -> None:
    """MODEL=llama: a tiny transformers LlamaForCausalLM (grouped K/V, untied) fine-tuned with LoRA
    on q/k/v/o/gate/up/down_proj under ZeRO-3 over 2 ranks; each checkpoint has the whole model in
    16 bits and the whole adapter, which peft loads onto the Hugging Face model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, max_position_embeddings=64, vocab_size=400,
                                      tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "llama")
    env = {**_given_hf_model(tmp_path, bpe_spec), "MODEL": "llama", "HF_DIR": str(tmp_path / "llama"), "NPROC": "2",
           "ITERS": "2"}
    del env["CONFIG"]
    _run(env, "--train.micro_batch_size", "1", "--train.global_batch_size", "4", "--checkpoint.interval", "2",
         "--train.log_interval", "1")
    losses = [r["loss"] for r in _records(tmp_path / "ft")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    latest = tmp_path / "ft" / "checkpoints" / "iter_0000002"
    assert (latest / "model_16bit.safetensors").exists()
    adapter = json.loads((latest / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 32 and set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"}
    from peft import PeftModel
    PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "llama"), latest / "adapter")


@pytest.mark.slow  # suite budget: tests/unit/test_finetune_data.py checks the rebuild rule in a second
def test_model_llama_takes_the_directorys_tokenizer_json_and_rebuilds_data_made_with_another(
        tmp_path, llama3_tokenizer_dir: str) -> None:
    """MODEL=llama with a Llama 3 style directory (tokenizer.json, no tokenizer.model): the
    question/answer set is tokenized with hf:HF_DIR, not the demo GPT-2 tokenizer; a set the
    script made earlier with another tokenizer is rebuilt, said in one line (issue 46, 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megazero.data.indexed import read_metadata
    from megazero.data.tokenizer import train_gpt2bpe
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=48, max_position_embeddings=64, vocab_size=300)).save_pretrained(llama)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(llama3_tokenizer_dir, name), llama)
    other = train_gpt2bpe(make_texts(200) + SAMPLES, 280, tmp_path / "bpe")  # fits the model too: both runs train
    env = {**_given_hf_model(tmp_path, other), "MODEL": "llama", "HF_DIR": str(llama), "ITERS": "1"}
    del env["CONFIG"]
    args = ("--train.micro_batch_size", "1", "--train.global_batch_size", "2", "--model.seq_length", "32")
    prefix = tmp_path / "data" / "qa_prompt_completion_document"
    first = _run(env, *args)
    assert f"== fine-tuning dataset (+ _loss_mask): building {prefix} with tokenizer {other}\n" in first.stdout
    del env["TOKENIZER"]
    second = _run({**env, "RUN_DIR": str(tmp_path / "ft2")}, *args)
    assert (f"== fine-tuning dataset (+ _loss_mask): rebuilding {prefix}: it was made with tokenizer {other}, not "
            f"hf:{llama}\n") in second.stdout
    assert read_metadata(str(prefix))["tokenizer_spec"] == f"hf:{llama}"
    assert len(_records(tmp_path / "ft2")) == 1
    third = _run({**env, "RUN_DIR": str(tmp_path / "ft3")}, *args)  # the same tokenizer: the set is kept
    assert "fine-tuning dataset" not in third.stdout


def test_model_llama_needs_a_hf_directory(tmp_path) -> None:
    proc = subprocess.run(["bash", "scripts/finetune_gpt.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MODEL": "llama", "HF_DIR": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: MODEL=llama fine-tunes a Hugging Face Llama")


def test_model_llama_without_a_tokenizer_in_hf_dir_is_one_line(tmp_path) -> None:
    """A Llama directory with neither tokenizer.json nor tokenizer.model, and no TOKENIZER: refused
    before anything is built, instead of tokenizing with the demo GPT-2 tokenizer."""
    (tmp_path / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZER"}
    proc = subprocess.run(["bash", "scripts/finetune_gpt.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "MODEL": "llama", "HF_DIR": str(tmp_path), "DATA_DIR": str(tmp_path / "data")})
    assert proc.returncode == 2 and proc.stderr == (
        f"error: HF_DIR {tmp_path} holds no tokenizer (tokenizer.json or tokenizer.model): add the model's tokenizer "
        f"files there, or set TOKENIZER to its tokenizer (hf:DIR, sentencepiece:FILE)\n"), proc.stderr
    assert not (tmp_path / "data").exists()
