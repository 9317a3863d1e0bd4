"""What benchmark scripts (scripts/) and tests share, so that neither edits sys.path to reach
the other: spawning ranks on this machine and collecting what each returned, free ports and
torchrun command lines (spawn.py), the one config builder (configs.py), and the check that
rebuilds data a script derived when its tokenizer changes (derived_data.py). Nothing in megazero
imports this package."""
