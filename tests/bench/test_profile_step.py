"""bench/profile_step.py: the kernel-name rule of its kinds of work, the arithmetic of its summaries
(shares of the wall time that sum to 1 with the launch gaps, the top kernels by GPU time, the
difference of two runs that makes one denoising step), and a --tiny run on the CPU that profiles the
real RL stage's parts and writes the results file, its JSON twin, --add and --compare."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from pipeline_helpers import REPO, worker_env

sys.path.insert(0, str(REPO / "bench"))
from profile_report import report  # noqa: E402
from profile_summary import CATEGORIES, GAPS, SHARES, KernelTable, busy_us, kernel_category, summarize, trace_activities  # noqa: E402
from train_step_setup import Settings  # noqa: E402

KERNELS = [
    # GEMMs: cuBLAS/CUTLASS on Ampere and Hopper, cuBLASLt's nvjet, Inductor's matmul templates, CPU operators
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(Params)", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(cublasLt::cublasSplitKParams<float>)", "gemm"),
    ("triton_tem_fused_addmm_0", "gemm"),
    ("aten::mm", "gemm"),
    ("aten::addmm", "gemm"),
    # attention: memory-efficient (its CUTLASS name), flash, cuDNN, FlexAttention's template, CPU SDPA
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("triton_tem_fused_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    # sampling: softmax-family reductions, argmax, random draws, top-k (which gathers) and sorts
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>(float*, float const*, int)", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4> >(...)", "sampling"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4>(int, PhiloxCudaState)", "sampling"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, unsigned int>)", "sampling"),
    ("void at::native::bitonicSortKVInPlace<2, -1, 16, 16, float, long>(...)", "sampling"),
    ("triton_red_fused__log_softmax_0", "sampling"),
    ("aten::_softmax", "sampling"),
    ("aten::exponential_", "sampling"),
    # copies
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, FillFunctor<float>)", "copy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 2, 64, 64>", "copy"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...> >(long, ...)", "copy"),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8>(int, ...)", "copy"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("aten::copy_", "copy"),
    ("aten::cat", "copy"),
    # other: elementwise arithmetic, norms, sums, and Inductor's fused kernels (a `_to_copy` cast among their ops)
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, MulFunctor<float> >, std::array<char*, 3ul> >", "other"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int, float, ...)", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, sum_functor>, unsigned int, float, 4> >", "other"),
    ("triton_poi_fused__to_copy_add_mul_rsqrt_0", "other"),
    ("aten::mul", "other"),
]


@pytest.mark.parametrize("name,kind", KERNELS)
def test_kernel_names_fall_in_their_kind(name, kind):
    assert kernel_category(name) == kind


def test_every_kind_is_one_of_the_categories():
    assert {kernel_category(name) for name, _ in KERNELS} == set(CATEGORIES)
    assert SHARES == CATEGORIES + (GAPS,)


def _event(name, ts, dur, cat="kernel", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def test_gpu_summary_shares_sum_to_one_with_the_launch_gaps():
    trace = {"traceEvents": [
        _event("sm90_xmma_gemm_bf16", 0, 12), _event("flash_fwd_kernel", 5, 8),  # overlapping: the busy time counts it once
        _event("cunn_SoftMaxForward", 30, 5), _event("Memcpy DtoD (Device -> Device)", 40, 6, cat="gpu_memcpy"),
        _event("aten::mm", 0, 50, cat="cpu_op"), _event("ProfilerStep", 0, 60, cat="gpu_user_annotation"),  # not GPU work
        {"ph": "M", "name": "process_name", "pid": 1, "args": {}},
    ]}
    activities = trace_activities(trace, gpu=True)
    assert sorted(a.name for a in activities) == ["Memcpy DtoD (Device -> Device)", "cunn_SoftMaxForward", "flash_fwd_kernel",
                                                  "sm90_xmma_gemm_bf16"]
    assert busy_us(activities) == 13 + 5 + 6
    s = summarize(KernelTable.of(activities, wall_us=60.0), top=2)
    assert s["kernel_us"] == 31 and s["busy_us"] == 24
    assert s["shares"][GAPS] == pytest.approx(36 / 60)
    assert s["shares"]["gemm"] == pytest.approx(12 / 31 * 24 / 60)  # the busy time split by kernel time
    assert s["shares"]["other"] == 0
    assert sum(s["shares"].values()) == pytest.approx(1.0)
    assert [(k["name"], k["category"]) for k in s["top"]] == [("sm90_xmma_gemm_bf16", "gemm"), ("flash_fwd_kernel", "attention")]
    assert [k["share"] for k in s["top"]] == pytest.approx([12 / 31, 8 / 31])


def test_cpu_activities_are_each_operators_own_time():
    trace = {"traceEvents": [
        _event("aten::linear", 0, 100, "cpu_op"), _event("aten::t", 1, 2, "cpu_op"), _event("aten::addmm", 5, 90, "cpu_op"),
        _event("aten::empty", 10, 1, "cpu_op"),  # inside the addmm: taken out of its own time
        _event("aten::softmax", 100, 20, "cpu_op"), _event("aten::_softmax", 101, 18, "cpu_op"),
        _event("aten::copy_", 50, 10, "cpu_op", tid=2),  # another thread: nested in nothing there
        _event("my_range", 0, 120, "user_annotation"),
    ]}
    activities = trace_activities(trace, gpu=False)
    table = KernelTable.of(activities, wall_us=150.0)
    assert {n: us for n, (_, us) in table.kernels.items()} == {
        "aten::linear": 1 + 2 + 5, "aten::t": 2, "aten::addmm": 89, "aten::empty": 1, "aten::softmax": 2, "aten::_softmax": 18,
        "aten::copy_": 10}
    assert {n: calls for n, (calls, _) in table.kernels.items()} == dict.fromkeys(table.kernels, 1)  # linear: 3 pieces, 1 run
    assert len(activities) == 11  # linear, addmm and softmax in pieces around what runs inside them
    assert table.busy_us == 120  # the other thread's copy lies inside the linear's time
    assert summarize(table)["category_us"]["gemm"] == 89


def test_a_difference_of_two_runs_over_its_steps():
    two = KernelTable({"gemm_a": [2, 20.0], "softmax_b": [1, 5.0]}, busy_us=25.0, wall_us=40.0)
    one = KernelTable({"gemm_a": [1, 10.0], "copy_c": [1, 3.0]}, busy_us=13.0, wall_us=20.0)
    step = two.minus(one).scaled(1 / 2)
    assert step.kernels == {"gemm_a": [0.5, 5.0], "softmax_b": [0.5, 2.5], "copy_c": [-0.5, -1.5]}
    assert (step.busy_us, step.wall_us) == (6.0, 10.0)
    s = summarize(step)
    assert s["category_us"] == {"gemm": 5.0, "attention": 0.0, "sampling": 2.5, "copy": 0.0, "other": 0.0}  # noise left out
    assert sum(s["shares"].values()) == pytest.approx(1.0) and s["shares"][GAPS] == pytest.approx(0.4)
    assert [k["name"] for k in s["top"]] == ["gemm_a", "softmax_b", "copy_c"]
    # a wall time measured apart that comes out under the busy time: no gaps, the busy time stands for it
    s = summarize(KernelTable({"gemm_a": [1, 8.0]}, busy_us=8.0, wall_us=6.0))
    assert s["shares"] == {**dict.fromkeys(SHARES, 0.0), "gemm": 1.0}


def _table(text: str, heading: str) -> list[list[str]]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows]


def test_tiny_run_profiles_the_stage_parts_and_keeps_its_rows(tmp_path):
    """Two runs (about 20 s each on two busy cores): the denoise step and the training micro-batch,
    then the scoring micro-batch with --add (the first run's rows kept) and --compare (against them)."""
    out, work = tmp_path / "profile_step.md", tmp_path / "work"
    env = {**worker_env(), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(REPO / "bench" / "profile_step.py"), "--tiny", "--workdir", str(work), "--out", str(out),
            "--shapes", "llada", "--repeats", "1"]
    r = subprocess.run(base + ["--phases", "denoise", "training"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    before = tmp_path / "before.json"
    shutil.copy(out.with_suffix(".json"), before)
    r = subprocess.run(base + ["--phases", "scoring", "--add", "--compare", str(before)], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out.read_text()

    assert re.search(r"^Git commit: \S+", text, re.M) and re.search(r"^Hardware: .*CPU cores.*torch", text, re.M)
    earlier = r"^Earlier command \(rows kept by --add\): `python3 bench/profile_step.py --tiny .*--phases denoise training`"
    assert re.search(earlier, text, re.M)
    shares = _table(text, "## Where the wall time goes")
    assert [row[1] for row in shares] == ["denoise", "training", "scoring"]
    for row in shares:
        assert float(row[3]) > 0 and float(row[4].replace(",", "")) > 0  # wall ms, operators per unit
        assert sum(float(c.rstrip("%")) for c in row[5:]) == pytest.approx(100, abs=0.35)  # six cells rounded to 0.1 %
    assert "1 denoising step of 16 rollouts (mean of a 4-step block of 8, dual cache)" in shares[0][2]
    assert "forward + backward" in shares[1][2] and "no gradients" in shares[2][2]
    assert text.count("### LLaDA-8B-Instruct: ") == 3

    data = json.loads(out.with_suffix(".json").read_text())
    assert len(data["runs"]) == 2 and [(r["shape"], r["phase"]) for r in data["rows"]] == [
        ("llada", "denoise"), ("llada", "training"), ("llada", "scoring")]
    denoise = data["rows"][0]
    # the raw tables of both runs are kept, and the unit is their difference over the block's steps
    one, two = (KernelTable(**denoise["measured"][k]) for k in ("1 block", "2 blocks"))
    assert denoise["per_step"]["wall_us"] == pytest.approx((two.wall_us - one.wall_us) / denoise["steps_per_block"])
    assert two.busy_us > one.busy_us > 0
    for row in data["rows"]:
        assert sum(row["summary"]["shares"].values()) == pytest.approx(1.0)
        assert all(os.path.exists(t) for t in row["traces"])

    compared = _table(text, "## Against")
    assert [(row[1], row[4]) for row in compared] == [("denoise", "1.00x"), ("training", "1.00x")]
    # the report is a function of the JSON alone: the same file rebuilt from it
    rebuilt = report(data, Settings.tiny(), tiny=True, compare=(before, json.loads(before.read_text())))
    assert rebuilt == text
