"""The GPUs the planner knows: dense bf16 peak, memory, HBM bandwidth, and per-GPU bandwidth inside a
node (NVLink) and between nodes (the network adapter each GPU has in NVIDIA's reference systems).

Sources (NVIDIA's datasheets; bandwidths are one direction, half the bidirectional figures quoted):
A100 80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s, NVLink 600 GB/s bidirectional, one 200 Gb/s
HDR adapter per GPU in DGX A100. H100 SXM: 989 TFLOP/s, 3,350 GB/s, NVLink 900 GB/s, 400 Gb/s NDR per
GPU (DGX H100). H200 SXM: 989 TFLOP/s, 141 GB at 4,800 GB/s, NVLink 900 GB/s, 400 Gb/s per GPU.
B200 (HGX B200): 2,250 TFLOP/s bf16 dense, 180 GB at 8,000 GB/s, NVLink 1,800 GB/s, 400 Gb/s per GPU.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_tflops: float  # dense bf16
    memory_gib: float  # what the planner may fill (the card's memory in GiB)
    hbm_gbps: float  # GB/s
    nvlink_gbps: float  # GB/s per GPU, one direction
    network_gbps: float  # GB/s per GPU between nodes, one direction


GPUS = {
    "a100-80gb": Gpu("a100-80gb", 312.0, 80e9 / 2**30, 2039.0, 300.0, 25.0),
    "h100-80gb": Gpu("h100-80gb", 989.0, 80e9 / 2**30, 3350.0, 450.0, 50.0),
    "h200-141gb": Gpu("h200-141gb", 989.0, 141e9 / 2**30, 4800.0, 450.0, 50.0),
    "b200-180gb": Gpu("b200-180gb", 2250.0, 180e9 / 2**30, 8000.0, 900.0, 50.0),
}
# torch.cuda.get_device_name() fragments → table entry, for the trainer's MFU on a known GPU.
DEVICE_NAMES = {"A100": "a100-80gb", "H100": "h100-80gb", "H200": "h200-141gb", "B200": "b200-180gb"}


def gpu_of_device(device_name: str) -> Gpu | None:
    return next((GPUS[v] for k, v in DEVICE_NAMES.items() if k in device_name), None)
