#!/usr/bin/env bash
# Fine-tune the main job's GPT-2 on prompt/completion pairs, end to end.
#
# With no arguments, on a fresh machine: runs the main job (scripts/pretrain_gpt.sh) when it has
# no checkpoint yet, exports its latest checkpoint to Hugging Face GPT-2 format, builds
# question/answer pairs from the embedded corpus (prompt "Question: What does json.dumps
# do?\nAnswer:", completion: the first sentence of its docstring), tokenizes them with the main
# job's tokenizer into an indexed dataset with a loss mask (only completions count in the loss;
# one example a sample, never packed unless --data.pack_examples true), and fine-tunes from the
# export (checkpoint.init_from_hf) on the main job's layout. Running it again resumes (from
# $RUN_DIR/checkpoints, or the --checkpoint.save DIR given as an argument, unless --checkpoint.load is).
#
# MODEL=llama fine-tunes a Hugging Face model of the Llama family instead (HF_DIR, required: a
# LlamaForCausalLM directory with its tokenizer: tokenizer.json, Llama 3 style, or tokenizer.model):
# configs/llama-finetune.yaml, LoRA rank 32 on q/k/v/o/gate/up/down_proj under ZeRO-3 over all
# NPROC ranks, the 16-bit model and the whole adapter saved with each checkpoint.
#
# Environment (defaults in brackets):
#   MODEL [gpt2]   gpt2 or llama (then CONFIG [configs/llama-finetune.yaml], TP/PP [1], ZERO_STAGE [3],
#                  RUN_DIR [runs/llama-finetune])
#   CONFIG [configs/gpt2-cpu-demo.yaml]   NPROC [8]  TP [2]  PP [2]  ZERO_STAGE [1]
#   DATA_DIR [data]   TOKENIZER [HF_DIR's own when it has one (tokenizer.json: hf:HF_DIR; tokenizer.model:
#                  sentencepiece:HF_DIR; vocab.json + merges.txt: gpt2bpe:HF_DIR), else gpt2bpe:$DATA_DIR/tokenizer]
#                  (passed on to the main job too)
#   PRETRAIN_RUN_DIR [runs/gpt2-cpu-demo]   the main job's outputs (its RUN_DIR)
#   PRETRAIN_ITERS [the config's]   iterations of the main job, when this script runs it
#   FT_INPUT [pairs from the embedded corpus]   JSONL with "prompt" and "completion" fields
#   FT_PREFIX [$DATA_DIR/qa_prompt_completion_document, built if absent]   WORKERS [2] tokenizing processes
#          a set this script built (FT_PREFIX.derived.json names its tokenizer; at the default FT_PREFIX, one
#          without that manifest too) is rebuilt, said in one line, when TOKENIZER is another tokenizer now;
#          a set of your own (FT_PREFIX given, no manifest) is never touched
#   RUN_DIR [runs/gpt2-cpu-demo-finetune]   ITERS [100]   LR [3e-4]   MIN_LR [3e-5]   WARMUP [10]
#   HF_DIR [$RUN_DIR/init_hf_<main job's iteration>]   the Hugging Face GPT-2 directory fine-tuning
#          starts from; when it exists already, the main job is neither run nor exported
#   LORA_RANK [unset]   passed as --finetune.lora_rank (needs the finetune config section, LoRA)
#   FINETUNE_ARGS [unset]   more overrides, word-split, e.g. "--finetune.lora_alpha 16"
#   MASTER_PORT [29500]   RESTARTS [3]
# Arguments are passed on to megazero.train as overrides, e.g. --train.global_batch_size 16.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/args.sh

# A Hugging Face directory given as HF_DIR is fine-tuned with its own tokenizer (unless TOKENIZER names one):
# the data must be tokenized as the model was trained.
if [[ -z ${TOKENIZER:-} && -n ${HF_DIR:-} && -f $HF_DIR/config.json ]]; then
  if hf_tokenizer=$(python -m megazero.harness.derived_data tokenizer "$HF_DIR"); then export TOKENIZER=$hf_tokenizer; fi
fi
case ${MODEL:=gpt2} in
  gpt2) ;;
  llama)
    if [[ -z ${HF_DIR:-} || ! -f $HF_DIR/config.json ]]; then
      echo "error: MODEL=llama fine-tunes a Hugging Face Llama directory: set HF_DIR to one (config.json, model.safetensors)" >&2
      exit 2
    fi
    if [[ -z ${TOKENIZER:-} ]]; then
      echo "error: HF_DIR $HF_DIR holds no tokenizer (tokenizer.json or tokenizer.model): add the model's tokenizer files there, or set TOKENIZER to its tokenizer (hf:DIR, sentencepiece:FILE)" >&2
      exit 2
    fi
    export CONFIG=${CONFIG:-configs/llama-finetune.yaml} TP=${TP:-1} PP=${PP:-1} ZERO_STAGE=${ZERO_STAGE:-3}
    RUN_DIR=${RUN_DIR:-runs/llama-finetune} ;;
  *) echo "error: MODEL $MODEL is gpt2 or llama" >&2; exit 2 ;;
esac
export CONFIG=${CONFIG:-configs/gpt2-cpu-demo.yaml}
export NPROC=${NPROC:-8} TP=${TP:-2} PP=${PP:-2} ZERO_STAGE=${ZERO_STAGE:-1}
export DATA_DIR=${DATA_DIR:-data}
export TOKENIZER=${TOKENIZER:-gpt2bpe:$DATA_DIR/tokenizer}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PRETRAIN_RUN_DIR=${PRETRAIN_RUN_DIR:-runs/gpt2-cpu-demo}
own_prefix=$DATA_DIR/qa_prompt_completion_document
FT_PREFIX=${FT_PREFIX:-$own_prefix}
RUN_DIR=${RUN_DIR:-runs/gpt2-cpu-demo-finetune}
ITERS=${ITERS:-100}

# 1-2. The starting point: HF_DIR when it names an existing Hugging Face GPT-2 directory (any
# export, or a published GPT-2: its tokenizer files are TOKENIZER's default); else the main job's latest
# checkpoint (the main job is run first when it has none), exported once per checkpoint.
if [[ -z ${HF_DIR:-} || ! -f $HF_DIR/config.json ]]; then
  pretrained=$PRETRAIN_RUN_DIR/checkpoints
  if [[ ! -f $pretrained/latest ]]; then
    echo "== no checkpoint in $pretrained: running the main job first (scripts/pretrain_gpt.sh)"
    RUN_DIR=$PRETRAIN_RUN_DIR ITERS=${PRETRAIN_ITERS:-} bash scripts/pretrain_gpt.sh
  fi
  HF_DIR=${HF_DIR:-$RUN_DIR/init_hf_$(cat "$pretrained/latest")}
  if [[ ! -f $HF_DIR/config.json ]]; then
    echo "== exporting $pretrained (latest) to $HF_DIR"
    python -m megazero.convert --load "$pretrained" --to hf --output "$HF_DIR"
  fi
fi

# 3. Fine-tuning data: prompt/completion pairs tokenized with their loss mask, once per tokenizer (see FT_PREFIX).
own=()
if [[ $FT_PREFIX == "$own_prefix" ]]; then own=(--own); fi
stale=$(python -m megazero.harness.derived_data check "$FT_PREFIX" "$TOKENIZER" "${own[@]}")
if [[ -n $stale ]]; then
  echo "== fine-tuning dataset (+ _loss_mask): $stale"
  python data_tools/preprocess_data.py --prompt-key prompt --completion-key completion --tokenizer "$TOKENIZER" \
    --workers "${WORKERS:-2}" --output-prefix "${FT_PREFIX%_prompt_completion_document}" ${FT_INPUT:+--input "$FT_INPUT"}
  python -m megazero.harness.derived_data record "$FT_PREFIX" "$TOKENIZER"
fi

# 4. Fine-tune from the export, or resume when the save directory ($RUN_DIR/checkpoints, or the user's
#    --checkpoint.save) holds a checkpoint. checkpoint.load is set only then (null otherwise, whatever
#    the config says; the user's own --checkpoint.load wins): a run with checkpoint.load set never
#    reads checkpoint.init_from_hf (a torchrun restart resumes from checkpoint.save by itself).
# shellcheck disable=SC2206  # FINETUNE_ARGS is a list of words
extra=(${LORA_RANK:+--finetune.lora_rank "$LORA_RANK"} ${FINETUNE_ARGS:-})
SAVE=$(flag_value "$SAVE_FLAGS" "$@") || SAVE=$RUN_DIR/checkpoints
resume=(--checkpoint.load null)
if [[ -f $SAVE/latest ]]; then resume=(--checkpoint.load "$SAVE"); fi
train_args=(--config "$CONFIG" --parallel.tp "$TP" --parallel.pp "$PP" --zero.stage "$ZERO_STAGE"
  --data.mock false --data.prefix "$FT_PREFIX" --data.tokenizer "$TOKENIZER" --model.vocab_size auto
  --checkpoint.init_from_hf "$HF_DIR" --checkpoint.save "$SAVE" "${resume[@]}"
  --logging.jsonl "$RUN_DIR/metrics.jsonl" --train.iters "$ITERS" --optim.lr "${LR:-3e-4}"
  --optim.min_lr "${MIN_LR:-3e-5}" --optim.warmup_iters "${WARMUP:-10}" "${extra[@]}" "$@")
LOCAL_WORLD_SIZE=$NPROC python -m megazero.train --validate-only --quiet --world-size "$NPROC" "${train_args[@]}"
echo "== fine-tuning: $NPROC processes, tp $TP x pp $PP, ZeRO-$ZERO_STAGE, from $HF_DIR; outputs in $RUN_DIR"
# megazero.launch is torchrun (same arguments) that exits 2 for a user error (config, data,
# checkpoint) as megazero does, and ends any other failure in one line instead of a traceback.
launch python -m megazero.launch --nproc_per_node "$NPROC" --max-restarts "${RESTARTS:-3}" --rdzv-backend c10d \
  --rdzv-endpoint "127.0.0.1:${MASTER_PORT:-29500}" --rdzv-id megazero-finetune -m megazero.train "${train_args[@]}"

latest="$SAVE/$(cat "$SAVE/latest")"
echo "== done. metrics: $RUN_DIR/metrics.jsonl  checkpoints: $SAVE (latest: ${latest##*/})"
if [[ -d $latest/adapter ]]; then  # LoRA: the adapters alone, for PEFT on $HF_DIR
  echo "   LoRA adapters (PEFT): $latest/adapter  (base model: $HF_DIR)"
  echo "   merge them into a plain $MODEL model: python -m megazero.convert --load $latest --to hf --merge-lora --output $RUN_DIR/merged_hf"
fi
echo "   generate: python -m megazero.generate --load $latest --prompt 'Question: ...' --max-new-tokens 40"
