#!/usr/bin/env bash
# megazero's main job: pretrain GPT-2 end to end.
#
# With no arguments, on a fresh machine: builds an English corpus from text that ships with
# Python, trains a byte-level BPE tokenizer on it, tokenizes it into a Megatron indexed
# dataset, then trains a small GPT-2 on CPU with tp 2 x pp 2 x dp 2 and ZeRO-1, evaluating
# and checkpointing as it goes. Running it again resumes from the last checkpoint.
#
# Environment (defaults in brackets):
#   CONFIG [configs/gpt2-cpu-demo.yaml]   NPROC [8]  TP [2]  PP [2]  ZERO_STAGE [1]
#   ITERS [from the config]   RUN_DIR [runs/gpt2-cpu-demo]   DATA_DIR [data]
#   DATA_PREFIX [$DATA_DIR/corpus_text_document, built if absent]   TOKENIZER [gpt2bpe:$DATA_DIR/tokenizer]
#   VOCAB_SIZE [8192, for a tokenizer trained here]   INPUT [the embedded corpus]
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]  (passed to torchrun)
# Arguments are passed on to megazero.train as overrides, e.g. --train.precision bf16.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/gpt2-cpu-demo.yaml}
NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
ZERO_STAGE=${ZERO_STAGE:-1}
RUN_DIR=${RUN_DIR:-runs/gpt2-cpu-demo}
DATA_DIR=${DATA_DIR:-data}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
TOKENIZER=${TOKENIZER:-gpt2bpe:$DATA_DIR/tokenizer}
DATA_PREFIX=${DATA_PREFIX:-$DATA_DIR/corpus_text_document}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# 1. Tokenizer: train one on the corpus when none is there (nothing can be downloaded).
tok_dir=${TOKENIZER#gpt2bpe:}
if [[ $TOKENIZER == gpt2bpe:* && ! -f $tok_dir/vocab.json ]]; then
  echo "== training a byte-level BPE tokenizer (vocab $VOCAB_SIZE) into $tok_dir"
  python data_tools/train_tokenizer.py --type gpt2bpe --vocab-size "$VOCAB_SIZE" --output "$tok_dir" \
    ${INPUT:+--input "$INPUT"}
fi

# 2. Dataset: tokenize the corpus once into $DATA_PREFIX.{bin,idx}.
if [[ ! -f $DATA_PREFIX.idx ]]; then
  echo "== building the indexed dataset $DATA_PREFIX"
  python data_tools/preprocess_data.py --tokenizer "$TOKENIZER" --json-keys text --append-eod --workers 2 \
    --output-prefix "${DATA_PREFIX%_text_document}" ${INPUT:+--input "$INPUT"}
fi

# 3. Train (resumes when $RUN_DIR/checkpoints holds a checkpoint).
echo "== training: $NPROC processes, tp $TP x pp $PP x dp $((NPROC / (TP * PP))), ZeRO-$ZERO_STAGE; outputs in $RUN_DIR"
torchrun --nproc_per_node "$NPROC" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  -m megazero.train --config "$CONFIG" \
  --parallel.tp "$TP" --parallel.pp "$PP" --zero.stage "$ZERO_STAGE" \
  --data.mock false --data.prefix "$DATA_PREFIX" --data.tokenizer "$TOKENIZER" --model.vocab_size auto \
  --checkpoint.save "$RUN_DIR/checkpoints" --checkpoint.load "$RUN_DIR/checkpoints" \
  --logging.jsonl "$RUN_DIR/metrics.jsonl" ${ITERS:+--train.iters "$ITERS"} "$@"

echo "== done. metrics: $RUN_DIR/metrics.jsonl  checkpoints: $RUN_DIR/checkpoints (latest: $(cat "$RUN_DIR/checkpoints/latest"))"
echo "   resolved config: $RUN_DIR/checkpoints/config.yaml; run again to resume, or raise ITERS"
