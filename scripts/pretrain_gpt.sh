#!/usr/bin/env bash
# megazero's main job: pretrain GPT-2 end to end.
#
# With no arguments, on a fresh machine: builds an English corpus from text that ships with
# Python, trains a byte-level BPE tokenizer on it, tokenizes it into a Megatron indexed
# dataset, then trains a small GPT-2 on CPU with tp 2 x pp 2 x dp 2 and ZeRO-1, evaluating
# and checkpointing as it goes. Running it again resumes from the last checkpoint: the script
# saves to and resumes from $RUN_DIR/checkpoints, or the --checkpoint.save DIR (--save DIR) given
# as an argument (unless --checkpoint.load is given too). The metrics go to $RUN_DIR/metrics.jsonl;
# with a save directory of one's own (and no RUN_DIR), beside it, to DIR.metrics.jsonl, so that
# they never meet the default run's (a run never cuts or extends another's metrics: it moves
# them aside, to the same name with that run's id).
#
# The config is checked for the world size before anything is prepared or launched. When a
# worker dies, torchrun restarts every worker (up to RESTARTS times) and they resume from the
# latest complete checkpoint; NNODES may be a range MIN:MAX (elastic: the job goes on, or is
# restarted, at any node count in the range; the checkpoint is resharded to the new layout).
#
# Environment (defaults in brackets):
#   CONFIG [configs/gpt2-cpu-demo.yaml]   NPROC [8]  TP [2]  PP [2]  ZERO_STAGE [1]
#   ITERS [from the config]   RUN_DIR [runs/gpt2-cpu-demo]   DATA_DIR [data]
#   DATA_PREFIX [$DATA_DIR/corpus_text_document, built if absent]   TOKENIZER [gpt2bpe:$DATA_DIR/tokenizer]
#   VOCAB_SIZE [8192, for a tokenizer trained here]   INPUT [the embedded corpus]
#   PREPARE_ONLY [unset; 1: build the tokenizer and dataset, then stop (Slurm does this once)]
#   STREAM [unset; 1: no dataset is built: train straight from INPUT (a file, folder, glob or
#     hf:NAME; default: the embedded corpus written once as $DATA_DIR/corpus.jsonl), tokenized on
#     the fly by loader processes (data.stream); VALID_DOCS [50] documents held out for validation]
#   NNODES [1, or MIN:MAX]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]  RDZV_ID [megazero]
#   RESTARTS [3]  (passed to torchrun: c10d rendezvous at MASTER_ADDR:MASTER_PORT, --max-restarts)
# Arguments are passed on to megazero.train as overrides, e.g. --train.precision bf16, or as
# Megatron-LM flags (--tensor-model-parallel-size 2 --lr 3e-4 ...), which megazero.train translates.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/args.sh

CONFIG=${CONFIG:-configs/gpt2-cpu-demo.yaml}
NPROC=${NPROC:-8}
TP=${TP:-2}
PP=${PP:-2}
ZERO_STAGE=${ZERO_STAGE:-1}
# Where checkpoints go and where a run resumes from: one directory. The user's own save directory
# is both (their arguments come last: a --checkpoint.load of theirs still wins); its metrics go
# beside it unless RUN_DIR says where.
METRICS=""
if SAVE=$(flag_value "$SAVE_FLAGS" "$@") && [[ -z ${RUN_DIR:-} ]]; then METRICS=${SAVE%/}.metrics.jsonl; fi
RUN_DIR=${RUN_DIR:-runs/gpt2-cpu-demo}
SAVE=${SAVE:-$RUN_DIR/checkpoints}
METRICS=${METRICS:-$RUN_DIR/metrics.jsonl}
DATA_DIR=${DATA_DIR:-data}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
TOKENIZER=${TOKENIZER:-gpt2bpe:$DATA_DIR/tokenizer}
DATA_PREFIX=${DATA_PREFIX:-$DATA_DIR/corpus_text_document}
NNODES=${NNODES:-1}
RESTARTS=${RESTARTS:-3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Each rendezvous round gets a fresh store hosted by rank 0 (none of a failed attempt's keys).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
if [[ -n ${STREAM:-} ]]; then
  STREAM_SOURCE=${INPUT:-$DATA_DIR/corpus.jsonl}
  data_args=(--data.stream "$STREAM_SOURCE" --data.stream_valid_docs "${VALID_DOCS:-50}")
else
  data_args=(--data.prefix "$DATA_PREFIX")
fi
train_args=(--config "$CONFIG" --parallel.tp "$TP" --parallel.pp "$PP" --zero.stage "$ZERO_STAGE"
  --data.mock false "${data_args[@]}"
  --checkpoint.save "$SAVE" --checkpoint.load "$SAVE"
  --logging.jsonl "$METRICS" ${ITERS:+--train.iters "$ITERS"})

# 0. Check the config for the largest world size before preparing data or starting any process
#    (the vocabulary is the tokenizer's once it exists, else the size it is about to be trained with).
tok_dir=${TOKENIZER#gpt2bpe:}
if [[ $TOKENIZER == gpt2bpe:* && ! -f $tok_dir/vocab.json ]]; then vocab=(--data.tokenizer null --model.vocab_size "$VOCAB_SIZE")
else vocab=(--data.tokenizer "$TOKENIZER" --model.vocab_size auto); fi
LOCAL_WORLD_SIZE=$NPROC python -m megazero.train --validate-only --config-only --quiet --world-size $((NPROC * ${NNODES##*:})) "${train_args[@]}" \
  "${vocab[@]}" "$@"

# 1. Tokenizer: train one on the corpus when none is there (nothing can be downloaded).
if [[ $TOKENIZER == gpt2bpe:* && ! -f $tok_dir/vocab.json ]]; then
  echo "== training a byte-level BPE tokenizer (vocab $VOCAB_SIZE) into $tok_dir"
  python data_tools/train_tokenizer.py --type gpt2bpe --vocab-size "$VOCAB_SIZE" --output "$tok_dir" \
    ${INPUT:+--input "${INPUT#hf:}"}
fi

# 2. Dataset: tokenize the corpus once into $DATA_PREFIX.{bin,idx}; streaming, only the raw
#    embedded corpus is written when no INPUT is given (the run tokenizes it as it trains).
if [[ -n ${STREAM:-} ]]; then
  if [[ -z ${INPUT:-} && ! -f $STREAM_SOURCE ]]; then
    echo "== writing the embedded corpus as raw text to $STREAM_SOURCE (streamed: no dataset is built)"
    mkdir -p "$DATA_DIR"
    python -c "import sys; from megazero.data.corpus import write_default_corpus; write_default_corpus(sys.argv[1])" \
      "$STREAM_SOURCE"
  fi
elif [[ ! -f $DATA_PREFIX.idx ]]; then
  echo "== building the indexed dataset $DATA_PREFIX"
  python data_tools/preprocess_data.py --tokenizer "$TOKENIZER" --json-keys text --append-eod --workers 2 \
    --output-prefix "${DATA_PREFIX%_text_document}" ${INPUT:+--input "$INPUT"}
fi
if [[ -n ${PREPARE_ONLY:-} ]]; then
  echo "== prepared: tokenizer $TOKENIZER, $([[ -n ${STREAM:-} ]] && echo "raw text $STREAM_SOURCE" || echo "dataset $DATA_PREFIX")"
  exit 0
fi

# 3. Train (resumes when $SAVE holds a checkpoint). First the files it reads (the
#    dataset, the checkpoint it resumes) are checked as start-up would, before any process starts.
LOCAL_WORLD_SIZE=$NPROC python -m megazero.train --validate-only --quiet --world-size $((NPROC * ${NNODES##*:})) "${train_args[@]}" \
  --data.tokenizer "$TOKENIZER" --model.vocab_size auto "$@" > /dev/null
echo "== training: $NPROC processes per node, tp $TP x pp $PP, ZeRO-$ZERO_STAGE; checkpoints in $SAVE, metrics in $METRICS${STREAM_SOURCE:+; streaming $STREAM_SOURCE}"
# megazero.launch is torchrun (same arguments) that exits 2 for a user error (config, data,
# checkpoint) as megazero does, and ends any other failure in one line instead of a traceback.
launch python -m megazero.launch --nproc_per_node "$NPROC" --nnodes "$NNODES" --max-restarts "$RESTARTS" \
  --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-megazero}" \
  -m megazero.train "${train_args[@]}" --data.tokenizer "$TOKENIZER" --model.vocab_size auto "$@"

echo "== done. metrics: $METRICS  checkpoints: $SAVE (latest: $(cat "$SAVE/latest"))"
echo "   resolved config: $SAVE/config.yaml; run again to resume. To train longer, raise ITERS and"
echo "   pass --optim.override_schedule true: a resumed run keeps the checkpoint's LR schedule (its decay length) otherwise"
