"""optim.name muon: the single process trains as Hugging Face GPT-2 with torch.optim.Muon on the
blocks' matrices (q, k, v apart) and torch.optim.AdamW on the rest; every layout (dp at ZeRO
0-3, tp, pp, cp, CPU offload) equals the single process; Newton-Schulz runs once per matrix."""

from __future__ import annotations

import pytest
import torch

from helpers import make_config, make_trainer, run_distributed

transformers = pytest.importorskip("transformers")

HF = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=320, n_positions=48)
STEPS = 4
LR, MUON_LR = 3e-3, 0.02
ARGS = ["--model.num_layers", "2", "--model.hidden_size", "64", "--model.num_heads", "4", "--model.seq_length",
        "32", "--model.vocab_size", "auto", "--model.dropout", "0", "--data.mock", "true",
        "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--train.iters", str(STEPS),
        "--optim.name", "muon", "--optim.lr", str(LR), "--optim.min_lr", str(LR), "--optim.muon_lr", str(MUON_LR),
        "--optim.decay_style", "constant", "--optim.warmup_iters", "0", "--optim.clip_grad", "0.5",
        "--optim.weight_decay", "0.1", "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random GPT-2 with non-trivial LayerNorms and biases, saved as safetensors."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.1)
    path = tmp_path_factory.mktemp("hf-muon")
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _hf_matrices(model) -> list[tuple[torch.Tensor, slice]]:
    """HF GPT-2's Muon matrices as (Conv1D weight [in, out], its columns): q, k and v of each
    c_attn apart, the attention and MLP projections whole."""
    h = HF["n_embd"]
    out = []
    for block in model.transformer.h:
        out += [(block.attn.c_attn.weight, slice(i * h, (i + 1) * h)) for i in range(3)]
        out += [(w, slice(None)) for w in (block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight)]
    return out


def _transformers_losses(hf_dir: str, adjust: str) -> list[float]:
    """GPT2LMHeadModel trained with torch.optim.Muon on (out, in) copies of its matrices and
    torch.optim.AdamW (decay on the other matrices only) on the rest, after one global-norm clip."""
    from megazero.data.mock import MockGPTDataset
    cfg = make_config(ARGS)
    o = cfg.optim
    ds = MockGPTDataset(8 * STEPS, 32, HF["vocab_size"], cfg.train.seed)
    model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32)
    matrices = _hf_matrices(model)
    leaves = [torch.nn.Parameter(w.detach()[:, cols].T.clone()) for w, cols in matrices]  # nn.Linear's (out, in)
    taken = {id(w) for w, _ in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    muon = torch.optim.Muon(leaves, lr=MUON_LR, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, adjust_lr_fn=adjust)
    adam = torch.optim.AdamW([{"params": [p for p in rest if p.dim() > 1], "weight_decay": o.weight_decay},
                              {"params": [p for p in rest if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=LR, betas=(o.beta1, o.beta2), eps=o.eps)
    out = []
    for step in range(STEPS):
        rows = torch.stack([torch.as_tensor(ds[i]) for i in range(8 * step, 8 * step + 8)]).long()
        model.zero_grad()
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        for leaf, (w, cols) in zip(leaves, matrices):
            leaf.grad = w.grad[:, cols].T.contiguous()
        muon.step()
        adam.step()
        with torch.no_grad():
            for leaf, (w, cols) in zip(leaves, matrices):
                w[:, cols] = leaf.T
        out.append(loss.item())
    return out


def _losses(hf_dir: str, layout: list[str]) -> list:
    tr = make_trainer(ARGS + layout + ["--checkpoint.init_from_hf", hf_dir])
    return [tr.train_step()["loss"] for _ in range(STEPS)]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_single_process_trains_as_transformers_with_torch_muon(hf_dir, adjust):
    expected = _transformers_losses(hf_dir, adjust)
    ours, adamw = run_distributed(_both, 1, hf_dir, ["--optim.muon_adjust_lr", adjust])[0]
    assert max(abs(a - b) for a, b in zip(ours, expected, strict=True)) <= 1e-4, (ours, expected)
    # Muon's steps weigh: AdamW alone lands far outside that tolerance
    assert max(abs(a - b) for a, b in zip(adamw, expected, strict=True)) > 1e-2, (adamw, expected)


def _both(hf_dir: str, layout: list[str]) -> tuple[list, list]:
    return _losses(hf_dir, layout), _losses(hf_dir, layout + ["--optim.name", "adamw"])
