"""optim.name muon: the single process trains as Hugging Face GPT-2 with torch.optim.Muon on the
blocks' matrices (q, k, v apart) and torch.optim.AdamW on the rest; every layout (dp at ZeRO
0-3, tp, pp, cp, CPU offload) equals the single process; Newton-Schulz runs once per matrix."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    HF_TINY_GPT2,
    assert_momentum_checkpoints,
    hf_adamw,
    hf_reference_losses,
    hf_tiny_gpt2_args,
    loaded,
    make_config,
    make_trainer,
    momentum_checkpoints,
    muon_steps,
    run_distributed,
)

transformers = pytest.importorskip("transformers")

HF = HF_TINY_GPT2  # the model of hf_tiny_gpt2_dir
STEPS = 4
LR, MUON_LR = 3e-3, 0.02
ARGS = hf_tiny_gpt2_args(STEPS, [
    "--optim.name", "muon", "--optim.lr", str(LR), "--optim.min_lr", str(LR), "--optim.muon_lr", str(MUON_LR),
    "--optim.decay_style", "constant", "--optim.warmup_iters", "0", "--optim.clip_grad", "0.5"])


def _hf_matrices(model) -> list[tuple[torch.Tensor, slice]]:
    """HF GPT-2's Muon matrices as (Conv1D weight [in, out], its columns): q, k and v of each
    c_attn apart, the attention and MLP projections whole."""
    h = HF["n_embd"]
    out = []
    for block in model.transformer.h:
        out += [(block.attn.c_attn.weight, slice(i * h, (i + 1) * h)) for i in range(3)]
        out += [(w, slice(None)) for w in (block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight)]
    return out


def _transformers_losses(hf_tiny_gpt2_dir: str, adjust: str) -> list[float]:
    """GPT2LMHeadModel trained with torch.optim.Muon on (out, in) copies of its matrices and
    torch.optim.AdamW (decay on the other matrices only) on the rest, after one global-norm clip."""
    cfg = make_config(ARGS)
    o = cfg.optim
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_tiny_gpt2_dir, torch_dtype=torch.float32)
    matrices = _hf_matrices(model)
    leaves = [torch.nn.Parameter(w.detach()[:, cols].T.clone()) for w, cols in matrices]  # nn.Linear's (out, in)
    taken = {id(w) for w, _ in matrices}
    muon = torch.optim.Muon(leaves, lr=MUON_LR, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, adjust_lr_fn=adjust)
    adam = hf_adamw([p for p in model.parameters() if id(p) not in taken], o, LR)

    def step(_: int) -> None:
        for leaf, (w, cols) in zip(leaves, matrices):
            leaf.grad = w.grad[:, cols].T.contiguous()
        muon.step()
        adam.step()
        with torch.no_grad():
            for leaf, (w, cols) in zip(leaves, matrices):
                w[:, cols] = leaf.T
    return hf_reference_losses(model, STEPS, HF["vocab_size"], cfg.train.seed, o.clip_grad, step)


def _losses(hf_tiny_gpt2_dir: str, layout: list[str]) -> list:
    tr = make_trainer(ARGS + layout + ["--checkpoint.init_from_hf", hf_tiny_gpt2_dir])
    return [tr.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_single_process_trains_as_transformers_with_torch_muon(hf_tiny_gpt2_dir, adjust):
    expected = _transformers_losses(hf_tiny_gpt2_dir, adjust)
    ours, adamw = run_distributed(_both, 1, hf_tiny_gpt2_dir, ["--optim.muon_adjust_lr", adjust])[0]
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) <= 1e-4, (ours, expected)
    # Muon's steps weigh: AdamW alone lands far outside that tolerance
    assert max(abs(a - b) for a, b in zip(adamw, expected, strict=True)) > 1e-2, (adamw, expected)


def _both(hf_tiny_gpt2_dir: str, layout: list[str]) -> tuple[list, list]:
    return _losses(hf_tiny_gpt2_dir, layout), _losses(hf_tiny_gpt2_dir, layout + ["--optim.name", "adamw"])


# ----------------------------------------------------------------------------- layouts

TINY = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000", "--optim.name", "muon",
        "--optim.clip_grad", "0.5", "--optim.muon_lr", "0.02"]


def _run(args: list[str], iters: int = 3) -> bytes:
    """`iters` steps: this rank's full parameters, losses, and how many matrices it orthogonalised."""
    return muon_steps(TINY + args, iters=iters)


def _outs(world: int, args: list[str]) -> list[dict]:
    return loaded(run_distributed(_run, world, args))


@pytest.fixture(scope="module")
def reference() -> dict:
    return _outs(1, [])[0]


def _assert_equal(outs: list[dict], ref: dict, matrices: int) -> None:
    """Every rank's parameters (its TP shard) within 1e-5 of the single process's, the losses
    too, and each matrix orthogonalised once per step over all the ranks."""
    from megazero.parallel.placement import Placement
    for out in outs:
        if out["losses"][0] is not None:  # None on ranks without the loss (earlier pipeline stages)
            assert max(abs(a - b) for a, b in zip(out["losses"], ref["losses"], strict=True)) <= 1e-5
        for name, p in out["params"].items():
            full = ref["params"]["transformer.wte.weight" if name == "lm_head.weight" else name]
            if out["tp"] > 1 and p.shape != full.shape:
                dim = 1 if name.endswith("c_proj.weight") else 0
                stride = 3 if ".c_attn." in name else 1
                full = Placement(tuple(full.shape), dim, stride).shard(full, out["tp_rank"], out["tp"])
            torch.testing.assert_close(p, full, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(len(out["calls"]) for out in outs) == 3 * matrices


MATRICES = 4 * 6  # gpt2-tiny: 4 blocks of q, k, v, attention output, MLP up and down


def test_single_process_orthogonalises_every_matrix_once_per_step(reference):
    assert len(reference["calls"]) == 3 * MATRICES
    assert sorted(set(reference["calls"])) == [(64, 64), (64, 256), (256, 64)]


@pytest.mark.parametrize("layout", [["--zero.stage", "1"], ["--zero.stage", "3"]])
def test_dp2_equals_single_process(reference, layout):
    _assert_equal(_outs(2, layout), reference, MATRICES)


def test_tp2_equals_single_process(reference):
    _assert_equal(_outs(2, ["--parallel.tp", "2"]), reference, MATRICES)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--zero.stage", "0"], ["--zero.stage", "2"],
                                    ["--zero.stage", "2", "--zero.offload_optimizer", "cpu"],
                                    ["--parallel.pp", "2"], ["--parallel.cp", "2"]])
def test_more_layouts_equal_single_process(reference, layout):
    _assert_equal(_outs(2, layout), reference, MATRICES)


@pytest.mark.slow
def test_tp2_pp2_dp2_zero3_equals_single_process(reference):
    _assert_equal(_outs(8, ["--parallel.tp", "2", "--parallel.pp", "2", "--zero.stage", "3"]), reference, MATRICES)


# ----------------------------------------------------------------------------- checkpoints

def _checkpoints(root: str) -> dict:
    """dp 2 ZeRO-1: save, resume (helpers.momentum_checkpoints); between, a resume of the save's
    universal conversion at tp 2 ZeRO-3."""
    return momentum_checkpoints(TINY + ["--zero.stage", "1"], root, _resharded)


def _resharded(root: str) -> dict:
    import torch.distributed as dist

    from megazero.checkpoint.export import write_universal
    from megazero.checkpoint.load import open_checkpoint
    if dist.get_rank() == 0:
        write_universal(open_checkpoint(f"{root}/save"), f"{root}/universal")
    dist.barrier()
    other = make_trainer(TINY + ["--train.iters", "4", "--parallel.tp", "2", "--zero.stage", "3",
                                 "--checkpoint.load", f"{root}/universal"])
    return {"resharded": [other.train_step()["loss"] for _ in range(2)]}


def test_momentum_is_saved_resumed_bitwise_and_resharded(tmp_path):
    for out in run_distributed(_checkpoints, 2, str(tmp_path)):
        assert_momentum_checkpoints(out, "muon")
        assert max(abs(a - b) for a, b in zip(out["resharded"], out["straight"], strict=True)) <= 1e-5
