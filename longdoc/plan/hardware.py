"""Devices and links the planner knows, and the efficiency assumptions its step-time estimate uses.

Peak numbers are the vendors' dense bf16 figures; memory is what `nvidia-smi` reports as total
(H100 SXM 81,559 MiB, H200 SXM 143,771 MiB, A100 SXM 81,920 MiB). Host links: PCIe Gen5 x16 64 GB/s per
direction (H100/H200), Gen4 x16 32 GB/s (A100). Bandwidths are per GPU and per
direction: NVLink 4 (H100/H200) 450 GB/s, NVLink 3 (A100) 300 GB/s; InfiniBand one NIC per GPU,
NDR 400 Gb/s = 50 GB/s (H100/H200), HDR 200 Gb/s = 25 GB/s (A100). "cpu" describes one local
process of this project's CPU runs (1 thread, gloo over loopback), for planning CPU runs, in one of two
precisions (`device("cpu", precision)`): fp32, or bf16 autocast over fp32 weights (what `train.mixed_precision: auto`
picks on CPUs with native bf16, `longdoc.train.modeling.resolve_mixed_precision`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
# SmolLM2-135M + LoRA, 4k tokens, cp=2 on this project's AVX-512 BF16 EPYC: a bf16-autocast step takes 1.30x
# less CPU time than an fp32 one (README "CPU precision"); the planner scales the CPU's achieved rate by it.
CPU_BF16_SPEEDUP = 1.30

GIB = 2**30


def machine_memory_gib() -> float:
    """This machine's total RAM (local CPU ranks share it)."""
    import psutil

    return psutil.virtual_memory().total / GIB


def machine_available_gib() -> float:
    """This machine's RAM available now (free plus reclaimable caches): what ranks started now may take."""
    import psutil

    return psutil.virtual_memory().available / GIB


GPUS_PER_NODE = 8


@dataclass(frozen=True, kw_only=True)
class Device:
    name: str
    memory_gib: float  # total memory of one device (one process on CPU: the RAM it may use)
    peak_tflops: float  # dense matmul peak in the compute dtype
    hbm_gbps: float  # memory bandwidth, GB/s (optimizer step)
    nvlink_gbps: float  # per direction, between GPUs of one node
    ib_gbps: float  # per GPU NIC, between nodes
    host_gbps: float = 0.0  # device <-> host memory, per direction (PCIe, nominal): the checkpoint offload's link
    gpu: bool  # a GPU (FSDP2, foreach AdamW, NCCL) rather than a local CPU process
    compute_bytes: int  # bytes per matmul activation element: bf16 on GPUs and under CPU autocast, fp32 on CPU
    weight_bytes: int  # bytes per frozen weight element (LoRA base): bf16 on GPUs, fp32 on CPU (autocast casts
    #                    per op and keeps the weights as loaded)
    runtime_gib: float  # memory the runtime takes besides tensors (CUDA context + NCCL; Python + torch on CPU)
    slack: float  # allocator overhead as a fraction of the short-lived (non-persistent) bytes
    achieved: bool = False  # peak_tflops is a measured rate (no efficiency factor applies)
    # Attention kernels reach a fraction b / (b + knee) of their large-block rate on query blocks of b tokens:
    # what makes one big Ulysses kernel faster than a ring's small blocks. GPUs: an assumption (a formula until
    # measured on a device); CPU: fitted to the ring's measured CP efficiency at 8k and 16k (README Performance:
    # E 0.94 and 1.01 at cp=2, 2k and 4k-token zigzag chunks).
    attention_knee_tokens: float = 1024.0
    autocast: bool = False  # compute_bytes is autocast's: the residual stream and norms stay fp32

    @property
    def is_gpu(self) -> bool:
        return self.gpu

    @property
    def precision(self) -> Precision:
        return "bf16" if self.compute_bytes == 2 else "fp32"


DEVICES: dict[str, Device] = {
    "h100": Device(name="H100 SXM 80GB", memory_gib=79.65, peak_tflops=989.0, hbm_gbps=3350.0, nvlink_gbps=450.0,
                   ib_gbps=50.0, host_gbps=64.0, gpu=True, compute_bytes=2, weight_bytes=2, runtime_gib=1.5,
                   slack=0.10),
    "h200": Device(name="H200 SXM 141GB", memory_gib=140.4, peak_tflops=989.0, hbm_gbps=4800.0, nvlink_gbps=450.0,
                   ib_gbps=50.0, host_gbps=64.0, gpu=True, compute_bytes=2, weight_bytes=2, runtime_gib=1.5,
                   slack=0.10),
    "a100": Device(name="A100 SXM 80GB", memory_gib=80.0, peak_tflops=312.0, hbm_gbps=2039.0, nvlink_gbps=300.0,
                   ib_gbps=25.0, host_gbps=32.0, gpu=True, compute_bytes=2, weight_bytes=2, runtime_gib=1.5,
                   slack=0.10),
    # One gloo rank with 1 thread. runtime_gib: RSS of a training process before its first step, less its
    # weights (Python, torch, transformers, accelerate, gloo), measured on this project's machines (135M at 1 layer,
    # cp=2, a tensor tracker: 0.612 GiB RSS at the first forward with 0.119 GiB of live tensors); assumes
    # freed memory goes back to the OS (longdoc.train.metrics.return_freed_memory).
    # peak_tflops: the ~70 GFLOP/s per core that the CPU flash-attention kernels reach (docs/design.md).
    "cpu": Device(name="CPU process (fp32, gloo)", memory_gib=16.0, peak_tflops=0.07, hbm_gbps=10.0,
                  nvlink_gbps=0.6, ib_gbps=0.6, gpu=False, compute_bytes=4, weight_bytes=4, runtime_gib=0.49,
                  slack=0.0, achieved=True, attention_knee_tokens=180.0),
}
INTERCONNECTS = ("nvlink", "ib")


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """Fractions of peak that the step-time estimate assumes are reached (not measured by the planner)."""

    matmul_efficiency: float = 0.55  # dense layers (GEMMs): typical of well-tuned bf16 training
    attention_efficiency: float = 0.30  # flash-attention 2 forward+backward blocks (FA2 on H100 bf16: ~30%)
    link_efficiency: float = 0.80  # achieved / nominal bandwidth of NCCL p2p and collectives
    latency_s: float = 20e-6  # per message


def check_precision(precision: str | None) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (or None: the device's own), "
                         f"got {precision!r}")


def device(name: str, precision: Precision | None = None) -> Device:
    """The device `name` computing in `precision` (None: its own, bf16 on GPUs and fp32 on "cpu")."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    check_precision(precision)
    dev = DEVICES[name]
    if precision is None or precision == dev.precision:
        return dev
    if dev.is_gpu:
        raise ValueError(f"{name}: GPU plans assume bf16 compute (FSDP2 mixed precision); precision {precision!r} "
                         f"is planned for CPU ranks only (--gpu cpu)")
    return cpu_bf16(dev)


def cpu_bf16(dev: Device) -> Device:
    """`dev` (a CPU process) under bf16 autocast: bf16 matmul activations, fp32 weights, the measured speed-up."""
    return dataclasses.replace(dev, name=dev.name.replace("fp32", "bf16 autocast"), compute_bytes=2, autocast=True,
                               peak_tflops=dev.peak_tflops * CPU_BF16_SPEEDUP)


def cpu_precision(cpuinfo: str = "/proc/cpuinfo") -> Precision:
    """The precision a CPU training run would use on this machine (`train.mixed_precision: auto`)."""
    from longdoc.train.modeling import resolve_mixed_precision

    return "bf16" if resolve_mixed_precision("auto", cuda=False, cpuinfo=cpuinfo) == "bf16" else "fp32"


def link_gbps(dev: Device, interconnect: str, ranks: int) -> float:
    """Nominal per-GPU bandwidth of a group of `ranks` consecutive ranks.

    Groups that fit in one node talk over NVLink (interconnect="nvlink") or over the NIC
    (interconnect="ib": no NVLink, e.g. PCIe GPUs with RDMA); larger groups are limited by the NIC.
    """
    if interconnect not in INTERCONNECTS:
        raise ValueError(f"interconnect must be one of {INTERCONNECTS}, got {interconnect!r}")
    if ranks <= 1:
        return float("inf")
    if ranks <= GPUS_PER_NODE and interconnect == "nvlink":
        return dev.nvlink_gbps
    return dev.ib_gbps
