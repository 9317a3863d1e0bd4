"""scripts/bench_gpu.py on CPU: the kernel classifier, the per-kind aggregation and its printout,
the ratio table with peer rows (one failed), the CLI, one step of the Hugging Face peer, and
gpu_check.sh's choice of interpreter. The GPU paths themselves run in scripts/gpu_check.sh."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, load_script

ROOT = str(REPO)
bench_gpu = load_script("bench_gpu", "scripts")
HF_COMPILE, HF_EAGER, MEGAZERO, MEGAZERO_COMPILE = (bench_gpu.HF_COMPILE, bench_gpu.HF_EAGER, bench_gpu.MEGAZERO,
                                                    bench_gpu.MEGAZERO_COMPILE)
Row, add_ratios, table = bench_gpu.Row, bench_gpu.add_ratios, bench_gpu.table
KINDS, Profile, breakdown, collect, format_profiles = (bench_gpu.KINDS, bench_gpu.Profile, bench_gpu.breakdown,
                                                       bench_gpu.collect, bench_gpu.format_profiles)
is_host_sync, kernel_kind, short_name, top_kernels = (bench_gpu.is_host_sync, bench_gpu.kernel_kind,
                                                      bench_gpu.short_name, bench_gpu.top_kernels)

NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "GEMM",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "GEMM",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn": "GEMM",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)": "GEMM",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "GEMM",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, ...)":
        "norm",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u>(...)":
        "norm",
    "triton_per_fused__to_copy_add_native_layer_norm_3": "norm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>":
        "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<...>)": "attention",
    "triton_red_fused__log_softmax_nll_loss_forward_7": "loss",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>":
        "loss",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)": "loss",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>>":
        "elementwise",
    "triton_poi_fused__to_copy_gelu_5": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>":
        "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(...)>": "copies",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>(...)": "copies",
    "Memcpy DtoH (Device -> Pinned)": "copies",
    "Memset (Device)": "copies",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
    "void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, float>(...)": "optimizer",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
    "some_kernel_nobody_knows": "other",
}


@pytest.mark.parametrize("name, kind", list(NAMES.items()))
def test_kernel_kind(name, kind):
    assert kernel_kind(name) == kind


def test_host_syncs_are_the_blocking_runtime_calls():
    blocking = ["cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                "cuMemcpyDtoH_v2"]
    not_blocking = ["cudaMemcpyAsync", "cudaLaunchKernel", "cudaEventRecord", "cuMemcpyDtoHAsync_v2", "aten::item"]
    assert all(is_host_sync(n) for n in blocking)
    assert not any(is_host_sync(n) for n in not_blocking)


KERNELS = [("nvjet_tst_128x256", 6000.0, 40), ("ampere_bf16_s16816gemm", 2000.0, 8),
           ("pytorch_flash::flash_fwd_kernel", 1000.0, 24), ("Memcpy HtoD (Pageable -> Device)", 200.0, 4),
           ("ncclDevKernel_AllReduce", 800.0, 2), ("nvjet_tst_128x256", 0.0, 2)]


def test_breakdown_per_step_share_and_count():
    kinds = {k.kind: k for k in breakdown(KERNELS, steps=2)}
    assert list(kinds) == list(KINDS)
    assert kinds["GEMM"].ms_per_step == pytest.approx(4.0) and kinds["GEMM"].count_per_step == 25
    assert kinds["attention"].ms_per_step == pytest.approx(0.5)
    assert kinds["communication"].share == pytest.approx(800 / 10000)
    assert sum(k.share for k in kinds.values()) == pytest.approx(1.0)
    assert kinds["loss"].ms_per_step == 0 and kinds["loss"].share == 0
    assert all(k.share == 0 for k in breakdown([], steps=1))  # nothing recorded: no division by zero


def test_top_kernels_merge_names_longest_first():
    top = top_kernels(KERNELS, n=2)
    assert top == [("nvjet_tst_128x256", 6000.0, 42), ("ampere_bf16_s16816gemm", 2000.0, 8)]
    assert short_name("void " + "x" * 100, 20) == "x" * 17 + "..."


def test_collect_reads_kernels_and_syncs_off_the_profiler_entries():
    """Entries as torch.profiler's key_averages() gives them: kernels and copies on the device;
    ProfilerStep#N and record_function ranges also appear there, and must not count twice."""
    def entry(key, device, count, us=0.0, annotation=False):
        return SimpleNamespace(key=key, count=count, device_type=f"DeviceType.{device}", device_time_total=us,
                               is_user_annotation=annotation)

    entries = [entry("ProfilerStep#2", "CUDA", 1, 9000.0), entry("megazero.loss", "CUDA", 2, 500.0, annotation=True),
               entry("nvjet_tst_128x256", "CUDA", 40, 6000.0), entry("Memcpy DtoH (Device -> Pinned)", "CUDA", 3, 9.0),
               entry("aten::mm", "CPU", 40, 6000.0), entry("cudaStreamSynchronize", "CPU", 4),
               entry("cudaMemcpyAsync", "CPU", 3), entry("cudaDeviceSynchronize", "CPU", 1)]
    profile = collect(entries, steps=2)
    assert profile.kernels == [("nvjet_tst_128x256", 6000.0, 40), ("Memcpy DtoH (Device -> Pinned)", 9.0, 3)]
    assert profile.syncs == 5 and not profile.error
    assert "no CUDA kernels" in collect(entries[4:], steps=1).error  # a profiler without CUPTI


def test_profile_printout_is_compact_and_names_a_failed_profile():
    runs = {MEGAZERO: (Profile(2, KERNELS, syncs=6), 0.010),
            HF_EAGER: (Profile(2, KERNELS[:3], syncs=2), 0.012),
            HF_COMPILE: (Profile(2, error="RuntimeError: CUPTI unavailable"), 0.011)}
    lines = format_profiles("gpt2-124m", runs)
    text = "\n".join(lines)
    assert len(lines) <= 30 and max(map(len, lines)) <= 120
    assert "hf compile: profile failed: RuntimeError: CUPTI unavailable" in text
    gemm = next(line for line in lines if line.strip().startswith("GEMM"))
    assert gemm.split()[1:4] == ["4.00", "80.0%", "25"]  # megazero: 8000 of 10000 us, over 2 steps
    assert "5.0/10.0 ms idle 50%" in text  # 10 ms of kernels over 2 steps of 10 ms
    syncs = next(line for line in lines if line.strip().startswith("host syncs"))
    assert syncs.split()[2:] == ["3.0", "1.0"]
    assert "loss" not in [line.split()[0] for line in lines[2:]]  # kinds no runner has are left out
    assert "top 15 kernels of megazero" in text and "nvjet_tst_128x256" in text
    assert format_profiles("m", {MEGAZERO: (Profile(1, error="boom"), 1.0)})[1:] == ["  megazero: profile failed: boom"]


def _rows() -> list[Row]:
    common = dict(params_m=124.4, micro=16, accum=4, tokens_per_iter=65536, step_s=0.2, tflops=100.0,
                  peak_mem_gib=30.0, last_loss=10.9)
    return [Row("gpt2-124m", MEGAZERO, tokens_per_sec=300e3, mfu=0.4, **common),
            Row("gpt2-124m", HF_EAGER, tokens_per_sec=200e3, **common),
            Row("gpt2-124m", HF_COMPILE, error="out of memory at micro-batch 16; try --micro 8"),
            Row("gpt2-355m", MEGAZERO, tokens_per_sec=100e3, **common),
            Row("gpt2-355m", HF_COMPILE, tokens_per_sec=125e3, **common)]


def test_ratios_to_each_peer_of_the_same_model():
    rows = _rows()
    add_ratios(rows)
    assert rows[0].vs_hf_eager == pytest.approx(1.5) and rows[0].vs_hf_compile is None  # that peer failed
    assert rows[3].vs_hf_eager is None and rows[3].vs_hf_compile == pytest.approx(0.8)  # no eager row
    assert all(r.vs_hf_eager is None and r.vs_hf_compile is None for r in rows if r.runner != MEGAZERO)


def test_the_compiled_megazero_row_gets_ratios_too():
    common = dict(params_m=354.8, micro=16, accum=4, tokens_per_iter=65536, step_s=0.4, tflops=300.0)
    rows = [Row("gpt2-355m", MEGAZERO, tokens_per_sec=150e3, **common),
            Row("gpt2-355m", MEGAZERO_COMPILE, tokens_per_sec=180e3, **common),
            Row("gpt2-355m", HF_COMPILE, tokens_per_sec=120e3, **common)]
    add_ratios(rows)
    assert rows[1].vs_hf_compile == pytest.approx(1.5) and rows[0].vs_hf_compile == pytest.approx(1.25)
    assert table(rows).splitlines()[2].split()[:3] == ["gpt2-355m", "megazero", "compile"]


def test_table_with_peer_rows():
    rows = _rows()
    add_ratios(rows)
    lines = table(rows).splitlines()
    assert lines[0].split()[-6:] == ["vs", "hf", "eager", "vs", "hf", "compile"]
    assert lines[1].split()[:2] == ["gpt2-124m", "megazero"] and lines[1].split()[-2:] == ["1.50x", "n/a"]
    assert lines[1].split()[-5] == "40.0%"
    assert lines[2].split()[-2:] == ["-", "-"]  # peers get no ratio to themselves
    assert lines[3].split() == "gpt2-124m hf compile FAILED: out of memory at micro-batch 16; try --micro 8".split()
    assert lines[4].split()[-2:] == ["n/a", "0.80x"]
    assert "vs hf" not in table(rows, ratios=False)  # the progress lines, before the peers have run


def test_cli_defaults_and_refusals(capsys):
    args, overrides = bench_gpu.parse_args(["--iters", "12", "--train.recompute", "none"])
    assert (args.peers, args.peer_iters, args.profile, overrides) == ("both", 12, False, ["--train.recompute", "none"])
    assert args.megazero == "both" and bench_gpu.parse_args(["--megazero", "eager"])[0].megazero == "eager"
    assert bench_gpu.parse_args(["--peer-iters", "8", "--peers", "none"])[0].peer_iters == 8
    for argv, why in [(["--peer-iters", "5"], "--peer-iters (5) must exceed --warmup (5)"),
                      (["--trace", "t"], "add --profile"), (["--profile", "--profile-steps", "0"], "at least 1")]:
        with pytest.raises(SystemExit):
            bench_gpu.parse_args(argv)
        assert why in capsys.readouterr().err


def test_hf_peer_trains_the_config_shape_on_cpu():
    pytest.importorskip("transformers")
    cfg = bench_gpu.make_config("gpt2-tiny", 2, 2, 3, ["--model.dropout", "0.1"])
    torch.manual_seed(0)
    lm = bench_gpu.hf_model(cfg, "cpu")
    c = lm.config
    assert (c.n_layer, c.n_embd, c.n_head, c.n_positions, c.vocab_size) == (4, 64, 4, 64, 512)
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.1 and c._attn_implementation == "sdpa"
    optimizer = bench_gpu.peer_optimizer(lm, cfg)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.optim.weight_decay, 0.0]
    assert optimizer.defaults["betas"] == (cfg.optim.beta1, cfg.optim.beta2)
    generator = torch.Generator().manual_seed(1)
    batches = bench_gpu.token_batches(cfg, 2, 2, "cpu", generator)
    assert len(batches) == 2 and batches[0][0].shape == (2, 64) and torch.equal(batches[0][0][:, 1:],
                                                                               batches[0][1][:, :-1])
    before = lm.transformer.wte.weight.detach().clone()
    loss = bench_gpu.peer_step(bench_gpu.LossOf(lm), optimizer, batches, cfg.optim.clip_grad, "cpu")
    assert math.isfinite(loss) and abs(loss - math.log(512)) < 1.0
    assert not torch.equal(before, lm.transformer.wte.weight)


def test_llama_row_is_a_1b_llama_at_the_gpt2_rows_tokens_per_iteration():
    """The Llama row: Llama 3.2 1B's shape (1.24B, grouped K/V, SwiGLU, RMSNorm, rotary) at 2048
    tokens, 64k tokens per iteration like the GPT-2 rows; its peer is LlamaForCausalLM of the
    same shape (built on the meta device here) with as many parameters."""
    pytest.importorskip("transformers")
    from megazero.plan.formulas import model_parameters
    assert "llama-3.2-1b" in bench_gpu.parse_args([])[0].models
    tokens = {}
    for model, (micro, accum) in bench_gpu.SHAPES.items():
        cfg = bench_gpu.make_config(model, micro, accum, 3, [])
        tokens[model] = micro * accum * cfg.model.seq_length
    assert set(tokens.values()) == {65536}
    cfg = bench_gpu.make_config("llama-3.2-1b", *bench_gpu.SHAPES["llama-3.2-1b"], 3, ["--train.recompute", "none"])
    m = cfg.model
    assert (m.seq_length, m.activation, m.query_groups, m.rope_scaling, cfg.train.recompute) == \
        (2048, "swiglu", 8, "llama3", "none")
    lm = bench_gpu.hf_model(cfg, "meta")
    c = lm.config
    assert type(lm).__name__ == "LlamaForCausalLM" and c._attn_implementation == "sdpa" and not c.use_cache
    assert (c.num_key_value_heads, c.intermediate_size, c.rope_scaling["factor"], c.tie_word_embeddings) == \
        (8, 8192, 32.0, True)
    assert sum(p.numel() for p in lm.parameters()) == model_parameters(m) == 1_235_814_400


def test_hf_llama_peer_trains_the_config_shape_on_cpu():
    pytest.importorskip("transformers")
    cfg = bench_gpu.make_config("llama-tiny", 2, 2, 3, [])
    torch.manual_seed(0)
    lm = bench_gpu.hf_model(cfg, "cpu")
    c = lm.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size,
            c.tie_word_embeddings, c.attention_bias) == (4, 64, 4, 2, 512, False, False)
    optimizer = bench_gpu.peer_optimizer(lm, cfg)
    batches = bench_gpu.token_batches(cfg, 2, 2, "cpu", torch.Generator().manual_seed(1))
    before = lm.model.embed_tokens.weight.detach().clone()
    loss = bench_gpu.peer_step(bench_gpu.LossOf(lm), optimizer, batches, cfg.optim.clip_grad, "cpu")
    assert math.isfinite(loss) and abs(loss - math.log(512)) < 1.0
    assert not torch.equal(before, lm.model.embed_tokens.weight)


def test_moe_row_is_a_mixtral_whose_peer_has_as_many_parameters_and_adds_its_aux_loss():
    """The MoE row: a Mixtral-style model (8 experts, top-2) of 0.93B parameters, 0.31B active,
    at the other rows' 64k tokens per iteration; its peer is MixtralForCausalLM of the same shape
    (meta device), its load-balancing loss on at the config's coefficient."""
    pytest.importorskip("transformers")
    from megazero.plan.formulas import matmul_parameters, model_parameters
    assert "mixtral-1b" in bench_gpu.parse_args([])[0].models
    cfg = bench_gpu.make_config("mixtral-1b", *bench_gpu.SHAPES["mixtral-1b"], 3, [])
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_z_loss_coeff, m.seq_length) == (8, 2, 0.0, 1024)
    lm = bench_gpu.hf_model(cfg, "meta")
    c = lm.config
    assert type(lm).__name__ == "MixtralForCausalLM" and c.output_router_logits
    assert c.router_aux_loss_coef == m.moe_aux_loss_coeff > 0 and c._attn_implementation == "sdpa"
    assert sum(p.numel() for p in lm.parameters()) == model_parameters(m) == 933_880_832
    # active matmul weights: attention 37.7M, 2 of 8 experts 207.6M, routers 0.1M, the output layer 32.8M
    assert round(matmul_parameters(m) / 1e6) == 278


def test_hf_mixtral_peer_trains_with_its_aux_loss_on_cpu():
    """One step of the peer on the tiny Mixtral: its loss is the cross-entropy plus the
    coefficient times transformers' load-balancing loss."""
    pytest.importorskip("transformers")
    cfg = bench_gpu.make_config("mixtral-tiny", 2, 2, 3, [])
    torch.manual_seed(0)
    lm = bench_gpu.hf_model(cfg, "cpu")
    batches = bench_gpu.token_batches(cfg, 2, 2, "cpu", torch.Generator().manual_seed(1))
    inputs, labels = batches[0]
    out = lm(input_ids=inputs)
    plain = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
    with_aux = bench_gpu.LossOf(lm)(inputs, labels)
    assert torch.allclose(with_aux, plain + cfg.model.moe_aux_loss_coeff * out.aux_loss)
    optimizer = bench_gpu.peer_optimizer(lm, cfg)
    before = lm.model.embed_tokens.weight.detach().clone()
    loss = bench_gpu.peer_step(bench_gpu.LossOf(lm), optimizer, batches, cfg.optim.clip_grad, "cpu")
    assert math.isfinite(loss) and abs(loss - math.log(512)) < 1.0
    assert not torch.equal(before, lm.model.embed_tokens.weight)


def _stand_in(path, name: str) -> None:
    path.write_text(f"#!/bin/sh\necho \"stand-in {name} $*\"\nexit 1\n")
    path.chmod(0o755)


def test_gpu_check_uses_python3_when_python_is_missing(tmp_path):
    """gpu_check.sh runs $PYTHON, else python, else python3: each stand-in reports itself and
    fails the first Python part, so the script stops there for want of a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "timeout", "dirname"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    _stand_in(bin_dir / "python3", "python3")
    _stand_in(tmp_path / "mine", "mine")

    def first_python(**env) -> str:
        proc = subprocess.run([shutil.which("bash"), os.path.join(ROOT, "scripts", "gpu_check.sh")],
                              env={"PATH": str(bin_dir), "HOME": str(tmp_path), **env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "no usable CUDA device; stopping" in proc.stdout
        return next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("stand-in"))

    assert first_python() == "python3"
    assert first_python(PYTHON=str(tmp_path / "mine")) == "mine"
    _stand_in(bin_dir / "python", "python")
    assert first_python() == "python"
