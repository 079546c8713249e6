"""The memory-bound kernels of one Llama-3.2-3B block's training step alone on one GPU, each way
of doing them that the runtime and trainer could take: the masters' cast for the gather, the
gradients' hand-off into float32, AdamW, the clip. Prints each one's time and bytes moved per
second (the figures behind the trainer's AdamW kernel and the one-rank hand-off; docs/float8.md).

    python3 bench/step_kernel_rates.py
"""
import statistics
import time

import torch

D, F, KV = 3072, 8192, 1024
SHAPES = [(D + 2 * KV, D), (D, D), (2 * F, D), (D, F), (D,), (D,)]  # qkv, o, gate/up, down, norms


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) * 1e3 / reps)
    return statistics.median(out)


def report(name, ms, nbytes):
    print(f"{name:60s} {ms:7.3f} ms  {nbytes / ms / 1e9:5.2f} TB/s")


def main():
    dev = "cuda"
    n = sum(torch.Size(s).numel() for s in SHAPES)
    f32 = [torch.randn(s, device=dev) for s in SHAPES]
    flat32, flat16 = torch.randn(n, device=dev), torch.empty(n, device=dev, dtype=torch.bfloat16)
    views16 = list(flat16.split([t.numel() for t in f32]))
    report("foreach_copy_ fp32 tensors -> bf16 split views",
           timed(lambda: torch._foreach_copy_(views16, [t.view(-1) for t in f32])), 6 * n)
    report("copy_ flat fp32 -> flat bf16", timed(lambda: flat16.copy_(flat32)), 6 * n)
    g16 = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in SHAPES]
    out32 = torch.empty(1, n, device=dev)
    report("_chunk_cat bf16 grads -> fp32 [1, n]", timed(lambda: torch._chunk_cat(g16, 0, 1, out=out32)), 6 * n)
    views32 = list(out32.view(-1).split([t.numel() for t in g16]))
    report("foreach_copy_ bf16 grads -> fp32 split views",
           timed(lambda: torch._foreach_copy_(views32, [t.view(-1) for t in g16])), 6 * n)
    grads = [torch.randn(s, device=dev) for s in SHAPES]
    exp_avgs, exp_avg_sqs = [torch.zeros(s, device=dev) for s in SHAPES], [torch.zeros(s, device=dev) for s in SHAPES]
    steps = [torch.zeros((), device=dev) for _ in SHAPES]
    scale = torch.tensor(2.0, device=dev)

    def adamw(grad_scale=None):
        torch._fused_adamw_(f32, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, grad_scale=grad_scale)
    report("_fused_adamw_", timed(adamw), 28 * n)
    report("_fused_adamw_ with grad_scale (writes the gradients back)", timed(lambda: adamw(scale)), 32 * n)
    report("_foreach_mul_ grads by a tensor (the clip)", timed(lambda: torch._foreach_mul_(grads, scale)), 8 * n)
    report("_foreach_norm grads", timed(lambda: torch._foreach_norm(grads)), 4 * n)
    report("copy_ flat fp32 -> fp32 (the bandwidth within reach)", timed(lambda: flat32.copy_(out32.view(-1))), 8 * n)
    print(f"one block: {n} elements, {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
