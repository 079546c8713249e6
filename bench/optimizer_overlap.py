"""How much of AdamW's memory-bound step hides under bf16 GEMMs run beside it on a second stream,
on one GPU: the measurement behind not moving --optimizer-in-backward's step to a side stream
(docs/float8.md). Sizes of one Llama-3.2-3B block (tokens 4096 = seq 2048 x batch 2).

    python3 bench/optimizer_overlap.py
"""
import statistics
import time

import torch

T, D, F = 4096, 3072, 8192  # tokens, dim, ffn
NUMEL = 101_000_000         # one block's parameters
GEMM_ROUNDS, ADAM_STEPS = 20, 10


def timed(fn):
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3)
    return statistics.median(out[1:])


def main():
    torch.manual_seed(0)
    dev = "cuda"
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    a, w1, b = torch.randn(T, D, **bf16), torch.randn(D, 2 * F, **bf16), torch.randn(T, 2 * F, **bf16)
    w2, h = torch.randn(F, D, **bf16), torch.randn(T, F, **bf16)

    def gemms():  # 16 T D F FLOPs a round
        for _ in range(GEMM_ROUNDS):
            torch.mm(a, w1), torch.mm(b, w1.t()), torch.mm(a.t(), b), torch.mm(h, w2), torch.mm(h.t(), a)

    sizes = [NUMEL // 9] * 9
    params, grads = [torch.randn(s, device=dev) for s in sizes], [torch.randn(s, device=dev) for s in sizes]
    exp_avgs, exp_avg_sqs = [torch.zeros(s, device=dev) for s in sizes], [torch.zeros(s, device=dev) for s in sizes]
    steps = [torch.zeros((), device=dev) for _ in sizes]

    def adamw():
        for _ in range(ADAM_STEPS):
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    def beside(gemm_stream, adam_stream):
        def run():
            for s in (gemm_stream, adam_stream):
                s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(adam_stream):
                adamw()
            with torch.cuda.stream(gemm_stream):
                gemms()
            for s in (gemm_stream, adam_stream):
                torch.cuda.current_stream().wait_stream(s)
        return run

    gemm_ms, adam_ms = timed(gemms), timed(adamw)
    print(f"GEMMs alone {gemm_ms:.1f} ms ({16 * T * D * F * GEMM_ROUNDS / gemm_ms / 1e9:.0f} TFLOP/s)")
    print(f"AdamW alone {adam_ms:.1f} ms ({28 * NUMEL * ADAM_STEPS / adam_ms / 1e9:.2f} TB/s)")
    for name, gemm_stream in (("two streams", torch.cuda.Stream()),
                              ("GEMMs high priority", torch.cuda.Stream(priority=-1))):
        both = timed(beside(gemm_stream, torch.cuda.Stream()))
        print(f"both, {name} {both:.1f} ms: hidden {(gemm_ms + adam_ms - both) / adam_ms * 100:.0f}% of AdamW")


if __name__ == "__main__":
    main()
