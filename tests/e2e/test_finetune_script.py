"""scripts/finetune_gpt.sh end to end. Short form: fine-tune a given Hugging Face GPT-2 on a
few prompt/completion pairs (preprocess with the mask, validate, train under torchrun). Long form
(slow): from nothing, through the main job, its export, the embedded question/answer pairs,
fine-tuning and a resume."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from helpers import EXAMPLES, REPO
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


def test_model_llama_needs_a_hf_directory(tmp_path) -> None:
    proc = subprocess.run(["bash", "scripts/finetune_gpt.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MODEL": "llama", "HF_DIR": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: MODEL=llama fine-tunes a Hugging Face Llama")
