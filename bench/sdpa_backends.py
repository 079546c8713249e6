"""Times causal scaled_dot_product_attention forward + backward in bf16 with each backend at the
benchmark's shapes (1b: batch 4, 16 heads, seq 2048, head_dim 128; small: 2, 8, 512, 64), and
prints the backend ATen picks by default. Median of 20 timed calls after 3 warm-up calls.

    python3 bench/sdpa_backends.py
"""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"1b": (4, 16, 2048, 128), "small": (2, 8, 512, 64)}
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def time_ms(q, k, v, grad):
    def once():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    for _ in range(3):
        once()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for name, (b, h, t, d) in SHAPES.items():
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        default = SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True))
        print(f"{name} [{b}, {h}, {t}, {d}]: ATen's default {default.name}")
        for backend in BACKENDS:
            try:
                with sdpa_kernel(backend):
                    print(f"  {backend.name:20s} {time_ms(q, k, v, grad):7.3f} ms forward + backward")
            except RuntimeError as e:
                print(f"  {backend.name:20s} unavailable: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()
