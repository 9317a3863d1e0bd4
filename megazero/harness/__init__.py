"""What benchmark scripts (scripts/) and tests share, so that neither edits sys.path to reach
the other: spawning ranks on this machine and collecting what each returned, free ports and
torchrun command lines (spawn.py), and the one config builder (configs.py). Nothing in megazero
imports this package."""
