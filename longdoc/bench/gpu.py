"""CUDA section: TFLOP/s of longdoc's block kernels against one full flash-attention call of the same work.

    longdoc bench gpu                    # runs only where torch.cuda.is_available()

Work of a causal forward+backward over L tokens: 2 * heads * L^2 * head_dim (forward: QK^T and PV,
causal half) x 3.5 (the backward is 2.5 forwards). Three measurements per length, bf16:
  full      torch SDPA (flash backend) over the whole sequence: the reference TFLOP/s;
  kernel    longdoc's selected block kernel (kernels.select) on the same sequence as one causal block;
  N ranks   every block that rank r of an N-rank zigzag ring computes, through the real ring forward (fp32
            log-sum-exp merges) and backward, for r = 0..N-1 one after another on this GPU. The ring's
            messages become local copies, so the time is the ranks' compute alone: per-rank time = total / N,
            TFLOP/s = (work / N) / per-rank time. Its gap to `full` is what cutting attention into ring
            blocks costs in kernel efficiency at that rank count.
The functions take any device and dtype, so the CPU tests run them at toy sizes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from longdoc.bench.attention import timed
from longdoc.parallel import kernels
from longdoc.parallel import layout as layouts
from longdoc.parallel.ring import ring_backward, ring_forward


@dataclass(kw_only=True)
class KernelBenchConfig:
    lengths: tuple[int, ...] = (8192, 32768, 131072)
    ranks: tuple[int, ...] = (2, 4, 8)
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    repeats: int = 5
    device: str = "cuda"


class _Done:
    def wait(self) -> None:
        pass


class _LocalRing:
    """A ring of `size` simulated ranks on one device: K/V "arrive" as copies of the right rank's shard."""

    guard = None  # no process group, nothing to check

    def __init__(self, rank: int, size: int, kv_shards: list[torch.Tensor]):
        self.rank, self.size, self.kv, self.hops = rank, size, kv_shards, 0

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Done:
        if tag == 0:  # K/V: after h hops a rank holds the shard of rank - h
            self.hops += 1
            recv.copy_(self.kv[(self.rank - self.hops) % self.size])
        else:  # a dK/dV accumulator: its contents do not change the work, only its size matters
            recv.copy_(send)
        return _Done()


def attention_flops(seq_len: int, heads: int, head_dim: int) -> float:
    return 2.0 * heads * seq_len**2 * head_dim * 3.5


def _timed(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return statistics.median(timed(fn, repeats, sync))


def _inputs(cfg: KernelBenchConfig, n: int, device: torch.device):
    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator(device=device).manual_seed(0)

    def r(h):
        return torch.randn(1, h, n, cfg.head_dim, device=device, dtype=dtype, generator=g)

    return r(cfg.heads), r(cfg.kv_heads), r(cfg.kv_heads), r(cfg.heads)


def _full(q, k, v, dout, device):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def sdpa(kk, vv):
        if device.type != "cuda":
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)

    try:  # decided once, outside the timed calls
        sdpa(k, v)
        kk, vv = k, v
    except RuntimeError:  # a flash build without GQA: expand K/V (not counted as work)
        g = q.shape[1] // k.shape[1]
        kk, vv = (t.detach().repeat_interleave(g, dim=1).requires_grad_() for t in (k, v))

    def step():
        out = sdpa(kk, vv)
        torch.autograd.grad(out, (q, kk, vv), dout)

    return step


def _block(q, k, v, dout, kernel, scale):
    def step():
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(dout, q, k, v, out, lse, True, scale)

    return step


def _simulated_ranks(q, k, v, dout, size, kernel, scale, layout="zigzag"):
    local = [[layouts.shard(t, 2, r, size, layout) for t in (q, k, v, dout)] for r in range(size)]
    kv = [torch.stack([lk, lv]) for _, lk, lv, _ in local]

    def step():
        for r, (lq, lk, lv, ld) in enumerate(local):
            out, lse = ring_forward(lq, lk, lv, _LocalRing(r, size, kv), layout, True, scale, kernel)
            ring_backward(ld, lq, lk, lv, out, lse, _LocalRing(r, size, kv), layout, True, scale, kernel)

    return step


def run(cfg: KernelBenchConfig, log=print) -> dict:
    """Time the full call, the block kernel and N simulated ranks at every length; TFLOP/s for each."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    kernel = kernels.select(device, dtype)
    scale = kernels.default_scale(cfg.head_dim)
    rows = []
    for n in cfg.lengths:
        q, k, v, dout = _inputs(cfg, n, device)
        work = attention_flops(n, cfg.heads, cfg.head_dim)
        full_name = "full SDPA flash" if device.type == "cuda" else "full SDPA"
        variants = [(full_name, _full(q, k, v, dout, device), 1),
                    (f"kernel {kernel.name}, 1 block", _block(q, k, v, dout, kernel, scale), 1)]
        for size in cfg.ranks:
            if n % (2 * size) == 0:
                # the N ranks' blocks are timed together; each rank's share of the work is work / N
                variants.append((f"{size} ranks (per rank)", _simulated_ranks(q, k, v, dout, size, kernel, scale),
                                 size))
        for name, fn, ranks in variants:
            seconds = _timed(fn, cfg.repeats, device)
            per_rank = seconds / ranks
            tflops = work / seconds / 1e12
            rows.append({"seq_len": n, "variant": name, "seconds": per_rank, "tflops": tflops})
            log(f"  kernels {n:>7} tokens {name:<28} {per_rank * 1e3:9.2f} ms {tflops:7.1f} TFLOP/s")
        del q, k, v, dout
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"config": asdict(cfg), "device": name, "kernel": kernel.name, "rows": rows}


def to_markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [f"{result['device']}, {cfg['dtype']}, causal fwd+bwd, {cfg['heads']} heads ({cfg['kv_heads']} kv) x "
             f"{cfg['head_dim']}; median of {cfg['repeats']}. N ranks: every block of each simulated rank of an "
             f"N-rank zigzag ring, no communication; time per rank.",
             "", "| tokens | variant | ms | TFLOP/s |", "|---:|---|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['seq_len']:,} | {r['variant']} | {r['seconds'] * 1e3:.2f} | {r['tflops']:.1f} |")
    return "\n".join(lines)
