"""Check the roofline's layer terms on a real GPU (needs PyTorch and CUDA; not a test).

Times, with CUDA graphs and random bf16 weights, one decoder layer's linear layers of
(1) a dense model (Llama-3.1-8B's shapes) and (2) a MoE layer (Mixtral-8x7B's 8 experts, top 2,
each token routed to 2 distinct experts uniformly at random) at decode batches of 1 to 1,024
tokens, and prints them beside what kvsched's roofline charges for the same layer: max(FLOPs /
(peak x compute_efficiency), weight bytes read / (bandwidth x memory_efficiency)), where the MoE
layer reads the experts its tokens touch, E x (1 - (1 - k/E)^T) of E in expectation
(docs/hardware.md). Attention and the per-iteration overhead are left out of both.

    python benchmarks/roofline_gpu_check.py --gpu h200      # the kvsched catalogue GPU to compare
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvsched.hardware import get_gpu  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 64, 256, 1024)
CE, ME = 0.5, 0.8                    # the roofline's default efficiencies


def roofline(gpu, params_read: float, flops: float) -> float:
    return max(flops / (gpu.flops * CE), params_read * 2 / (gpu.bandwidth * ME))


def timed(torch, fn, reps: int = 20) -> float:
    """Seconds per call of `fn`, replayed as a CUDA graph (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1000


def dense(torch, gpu) -> None:
    h, inter, heads, kv, hd = 4096, 14336, 32, 8, 128
    dev, dt = "cuda", torch.bfloat16
    w = {n: torch.randn(shape, device=dev, dtype=dt) * 0.01 for n, shape in
         (("qkv", (h, (heads + 2 * kv) * hd)), ("o", (heads * hd, h)), ("gu", (h, 2 * inter)), ("d", (inter, h)))}
    params = sum(x.numel() for x in w.values())
    print(f"dense layer (Llama-3.1-8B shapes, {params / 1e6:.0f} M parameters)")
    print("tokens  measured ms  roofline ms  measured/roofline")
    for t in BATCHES:
        x = torch.randn(t, h, device=dev, dtype=dt)

        def layer():
            a = x @ w["qkv"]
            y = a[:, :heads * hd] @ w["o"]
            g, u = (y @ w["gu"]).chunk(2, dim=1)
            return (torch.nn.functional.silu(g) * u) @ w["d"]
        m = timed(torch, layer)
        r = roofline(gpu, params, 2 * params * t)
        print(f"{t:6d}  {m * 1e3:11.4f}  {r * 1e3:11.4f}  {m / r:17.2f}")


def moe(torch, gpu, samples: int = 4) -> None:
    h, inter, E, k = 4096, 14336, 8, 2
    dev, dt = "cuda", torch.bfloat16
    w1 = [torch.randn(h, 2 * inter, device=dev, dtype=dt) * 0.01 for _ in range(E)]
    w2 = [torch.randn(inter, h, device=dev, dtype=dt) * 0.01 for _ in range(E)]
    per_expert = 3 * h * inter
    rng = random.Random(0)
    print(f"MoE layer (Mixtral-8x7B shapes: {E} experts of {per_expert / 1e6:.0f} M parameters, top {k})")
    print("tokens  experts touched (mean; expected)  measured ms  roofline ms  measured/roofline")
    for t in BATCHES:
        times, touched = [], []
        for _ in range(samples):
            routes = [rng.sample(range(E), k) for _ in range(t)]
            rows = {e: [i for i, r in enumerate(routes) if e in r] for e in range(E)}
            used = [e for e in range(E) if rows[e]]
            idx = {e: torch.tensor(rows[e], device=dev) for e in used}
            x = torch.randn(t, h, device=dev, dtype=dt)
            out = torch.zeros(t, h, device=dev, dtype=dt)

            def layer():
                for e in used:
                    xe = x.index_select(0, idx[e])
                    g, u = (xe @ w1[e]).chunk(2, dim=1)
                    out.index_add_(0, idx[e], (torch.nn.functional.silu(g) * u) @ w2[e])
            times.append(timed(torch, layer))
            touched.append(len(used))
        m = statistics.mean(times)
        expected = E * (1 - (1 - k / E) ** t)
        r = roofline(gpu, per_expert * expected, 2 * per_expert * k * t)
        print(f"{t:6d}  {statistics.mean(touched):21.2f}; {expected:5.2f}  {m * 1e3:11.4f}  {r * 1e3:11.4f}  "
              f"{m / r:17.2f}")


def formats(torch, gpu) -> None:
    """bf16 against FP8 (torch._scaled_mm, per-tensor scales) GEMMs: a large square one
    (compute-bound: the format's FLOP rate) and a decode-shaped one (16 tokens x a 8192 x 28672
    weight: bandwidth-bound, FP8 reads half the bytes), beside the roofline's charge."""
    if "fp8" not in gpu.formats:
        return
    dev = "cuda"
    print("format  shape                   measured ms  TFLOP/s  roofline ms")
    for m, k, n in ((8192, 8192, 8192), (16, 8192, 28672)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev, dtype=torch.float32)
        for fmt, fn, rate, wbytes in (
                ("bf16", lambda: a @ b.t(), gpu.flops, 2),
                ("fp8", lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                 gpu.formats["fp8"], 1)):
            t = timed(torch, fn)
            flops = 2 * m * k * n
            r = max(flops / (rate * CE), (k * n * wbytes) / (gpu.bandwidth * ME))
            print(f"{fmt:6s}  {m:5d} x {k} x {n:5d}  {t * 1e3:11.4f}  {flops / t / 1e12:7.0f}  {r * 1e3:11.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200", help="the kvsched catalogue GPU to compare with")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    gpu = get_gpu(args.gpu)
    print(f"{torch.cuda.get_device_name()} against kvsched's {gpu.name}: {gpu.flops / 1e12:g} TFLOP/s bf16, "
          f"{gpu.bandwidth / 1e12:g} TB/s; efficiencies {CE} and {ME}")
    torch.manual_seed(0)
    dense(torch, gpu)
    moe(torch, gpu)
    formats(torch, gpu)


if __name__ == "__main__":
    main()
