"""scripts/bench_moe.py runs end to end on a shrunk shape (a smoke test: nothing about speed is
asserted), and its peer is the same model: transformers' MixtralForCausalLM of equal size."""

import subprocess
import sys

from helpers import REPO

SHRUNK = ["--model.hidden_size", "64", "--model.num_heads", "4", "--model.num_query_groups", "4",
          "--model.num_layers", "2", "--model.moe_ffn_hidden_size", "32", "--model.vocab_size", "512"]


def test_bench_moe_runs_and_its_peer_has_the_same_parameters():
    shrunk = SHRUNK
    proc = subprocess.run([sys.executable, "scripts/bench_moe.py", "--iters", "1", "--warmup", "1", "--seq", "32",
                           "--threads", "1", *shrunk], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    ours, peer = first.split(" parameters (peer ")[0].rsplit(" ", 1)[1], first.split("(peer ")[1].split(")")[0]
    assert ours == peer, first
    assert "megazero / Hugging Face:" in proc.stdout


def test_bench_moe_ep2_prints_each_runner_and_the_all_to_all_share():
    proc = subprocess.run([sys.executable, "scripts/bench_moe.py", "--ep", "2", "--iters", "1", "--warmup", "1",
                           "--seq", "32", *SHRUNK], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split()[:4] for line in proc.stdout.splitlines() if line.startswith("ep ") and "thread(s)" in line
            and "/" not in line]
    assert [r[:2] for r in rows] == [["ep", "1:"], ["ep", "1:"], ["ep", "2:"]], proc.stdout
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("ep 2 / ep 1, a rank each with 1 thread(s)") and "% of ep 2's step" in last, last
