# Sourced by pretrain_gpt.sh and finetune_gpt.sh: what the user's own arguments set.

# flag_value "--checkpoint.save --save" "$@" prints the value the last of these flags is given
# (--flag VALUE or --flag=VALUE); its status is 1 when none of them is given.
flag_value() {
  local names=" $1 " value="" given=1 take=""
  shift
  for arg in "$@"; do
    if [[ -n $take ]]; then value=$arg; take=""
    elif [[ $names == *" $arg "* ]]; then take=1; given=0
    elif [[ $arg == --*=* && $names == *" ${arg%%=*} "* ]]; then value=${arg#*=}; given=0; fi
  done
  printf '%s' "$value"
  return $given
}

# The flags (megazero's keys and their Megatron-LM aliases) naming the checkpoint directories.
SAVE_FLAGS="--checkpoint.save --save"
LOAD_FLAGS="--checkpoint.load --load"

# launch COMMAND...: runs the launcher (python -m megazero.launch ...) and waits for it, passing on
# the stop signals this shell gets (kill, Ctrl-C, a scheduler), which would otherwise kill bash
# alone and leave the launcher and its workers training: SIGTERM and SIGINT go to the launcher as
# SIGTERM (torchrun hands its own signal on to the workers, and they save and stop on SIGTERM but
# not on SIGINT), SIGUSR1 to the workers themselves (torchrun has no handler for it: it would end
# the launcher). An ignored signal stays ignored (Slurm's USR1 in pretrain_gpt.slurm). After a
# signal the script exits with the launcher's status (0: the workers saved and stopped); else
# launch returns it. The launcher runs in a process group of its own (set -m), so a Ctrl-C in the
# terminal reaches it once, through this shell.
launch() {
  set -m
  "$@" &
  LAUNCHER_PID=$!
  set +m
  LAUNCH_SIGNALLED=""
  trap 'LAUNCH_SIGNALLED=1; kill -TERM "$LAUNCHER_PID" 2>/dev/null || true' TERM INT
  trap 'LAUNCH_SIGNALLED=1; pkill -USR1 -P "$LAUNCHER_PID" || true' USR1
  local status stopped=""
  while :; do  # a trapped signal ends `wait` early, with the launcher still running: wait again
    status=0
    wait "$LAUNCHER_PID" || status=$?
    if [[ -z $LAUNCH_SIGNALLED ]]; then break; fi
    stopped=1 LAUNCH_SIGNALLED=""
  done
  trap - TERM INT USR1
  if [[ -n $stopped ]]; then exit "$status"; fi
  return "$status"
}
