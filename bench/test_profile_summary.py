"""Checks profile_summary's interval arithmetic on a hand-made trace (ctest)."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import profile_summary  # noqa: E402


def kernel(name, ts, dur, stream):
    return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(stream=stream))


# One 100 us step: compute 0-40 and 60-70 (stream 7), NCCL 30-80 (stream 20),
# a copy 90-95 on the NCCL stream; a kernel after the step is ignored.
trace = dict(traceEvents=[
    dict(ph="X", cat="user_annotation", name="ProfilerStep#1", ts=0, dur=100),
    kernel("sm90_gemm", 0, 40, 7), kernel("elementwise", 60, 10, 7),
    kernel("ncclDevKernel_AllGather", 30, 50, 20), kernel("copy", 90, 5, 20),
    kernel("sm90_gemm", 150, 10, 7)])
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(trace, f)
s = profile_summary.summarize(f.name)
os.unlink(f.name)
expected = dict(step_ms=0.1, compute_ms=0.055, nccl_ms=0.05, exposed_comm_ms=0.03, idle_ms=0.015, kernels=4)
for key, want in expected.items():
    assert abs(s[key] - want) < 1e-9, (key, s[key], want)
assert s["top_kernels"][0]["name"] == "ncclDevKernel_AllGather", s["top_kernels"]
assert s["gaps"] == [], s["gaps"]
# Kernel time by kind, summed (the NCCL kernel overlapping compute counts in full).
want = {"communication": 0.05, "matrix products": 0.04, "elementwise and other": 0.01, "copies and casts": 0.005}
assert s["kinds"].keys() == want.keys() and all(abs(s["kinds"][k] - v) < 1e-9 for k, v in want.items()), s["kinds"]
assert list(s["kinds"]) == list(want), "largest first"
# Names from the 8B's profiles on 4 H100s: each kind once.
for name, want in [("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
                   ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
                   ("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor<float,", "optimizer"),
                   ("fsdp::kernels::adamw_kernel(fsdp::kernels::Launch, fsdp::kernels::Scalars, float const*)", "optimizer"),
                   ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matrix products"),
                   ("detail::chunk_cat_cuda_kernel<float, c10::BFloat16>(c10::BFloat16**, float*, long*, long*,", "copies and casts"),
                   ("multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor<float, c10::BFloat16, 2, 1, 1", "copies and casts"),
                   ("triton_poi_fused__unsafe_view_cat_mul_silu_silu_backward_split_view_0", "elementwise and other"),
                   ("fsdp::kernels::rms_norm_backward_kernel<__nv_bfloat16>", "norms")]:
    assert profile_summary.kind(name) == want, (name, profile_summary.kind(name), want)
# The idle gaps, longest first, with their neighbours and the host op running as each began.
trace["traceEvents"].append(dict(ph="X", cat="cpu_op", name="aten::item", ts=82, dur=20))
trace["traceEvents"].append(dict(ph="X", cat="cpu_op", name="train_step", ts=0, dur=150))
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(trace, f)
s = profile_summary.summarize(f.name, gaps=5)
assert [(g["at_ms"], g["ms"]) for g in s["gaps"][0]] == [(0.08, 0.01), (0.095, 0.005)], s["gaps"]
assert s["gaps"][0][0]["before"] == "ncclDevKernel_AllGather" and s["gaps"][0][0]["after"] == "copy", s["gaps"]
assert [g["host"] for g in s["gaps"][0]] == ["train_step", "aten::item"] and s["gaps"][0][1]["after"] == "", s["gaps"]
# Exposed communication: NCCL 30-80 less compute 0-40 and 60-70 leaves 40-60 and 70-80, the
# collective named, the compute kernels either side, the host op running as each began.
s = profile_summary.summarize(f.name, exposed=5)
assert [(g["at_ms"], g["ms"]) for g in s["exposed"][0]] == [(0.04, 0.02), (0.07, 0.01)], s["exposed"]
assert {g["collective"] for g in s["exposed"][0]} == {"ncclDevKernel_AllGather"}, s["exposed"]
assert [(g["before"], g["after"]) for g in s["exposed"][0]] == [("sm90_gemm", "elementwise"), ("elementwise", "copy")]
assert s["gaps"] == [] and s["exposed"][0][0]["host"] == "train_step", s
assert profile_summary.difference([[0, 10], [20, 30]], [[5, 25]]) == [(0, 5), (25, 30)]
os.unlink(f.name)
print("profile_summary: ok")
