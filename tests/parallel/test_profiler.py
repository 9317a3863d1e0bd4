"""logging.profiler (Megatron-LM's --profile --use-pytorch-profiler --profile-step-start/end
--profile-ranks): a torch.profiler trace of the chosen steps, on the chosen ranks, beside the
TensorBoard logs."""

from __future__ import annotations

import contextlib
import io
import json
import os

from helpers import make_trainer, run_distributed


def _profiled_run(log_dir: str) -> list[int]:
    tr = make_trainer(["--train.iters", "4", "--logging.profiler", "torch", "--logging.profile_start", "1",
                       "--logging.profile_end", "3", "--logging.profile_ranks", "1",
                       "--logging.tensorboard", log_dir])
    with contextlib.redirect_stdout(io.StringIO()):
        return [r["iteration"] for r in tr.run()]


def test_torch_profiler_trace_of_the_chosen_steps_on_the_chosen_rank(tmp_path):
    log_dir = str(tmp_path / "tb")
    run_distributed(_profiled_run, 2, log_dir)
    traces = sorted(n for n in os.listdir(log_dir) if n.endswith(".pt.trace.json"))
    assert traces == ["rank1.iterations_2-3.pt.trace.json"]  # rank 0 is not in profile_ranks
    events = json.load(open(os.path.join(log_dir, traces[0])))["traceEvents"]
    names = {e.get("name") for e in events}
    # Iterations 2 and 3 (the steps begun with 1 and 2 done), not 1 or 4; their forward's matmuls
    # and the optimizer's step inside them.
    assert {"iteration 2", "iteration 3"} <= names and not {"iteration 1", "iteration 4"} & names
    assert names & {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"}
