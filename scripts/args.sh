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
