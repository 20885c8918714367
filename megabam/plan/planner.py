"""A layout's communication, step time and MFU on given GPUs, the verdict on the config's own layout,
and the best layouts ranked by predicted throughput.

Step time is a roofline: each rank's work is its FLOPs at the GPU's dense peak plus its bytes at the
HBM bandwidth (weights read three times per micro-batch, activations written and read once, the
optimizer's partition read and written once per step: the elementwise passes wait for memory, not
for the matmuls); 1F1B's bubble stretches it by
(M + PP − 1) / M; tensor-parallel collectives (two per block forward, two backward, two more under full
recomputation; ring all-reduce bytes 2(t−1)/t of the message) run at NVLink speed inside a node and at
the network's between nodes and are not overlapped; so is ZeRO's gradient reduce-scatter and
parameter all-gather (DeepSpeed's default overlap_comm=false for ZeRO-1) and the pipeline's
activation sends. It is an upper bound: kernels below peak, launch gaps and imbalance are not in it.
Its work is kept by kind (attention, recurrent cells and the weights' matmuls at the peak; elementwise
passes and the optimizer at HBM bandwidth) for the calibrated estimate beside it, where a GPU measured
how far below the roofline each kind runs (calibration.py).
"""

import dataclasses
from dataclasses import dataclass

from megabam.config import Config, ConfigError
from megabam.config.loader import config_from_dict
from megabam.model import Decoder
from megabam.plan.calibration import Calibration
from megabam.plan.counts import (
    forward_flops_by_component,
    meta_model,
    params_by_component,
    recompute_share,
    window_draws,
)
from megabam.plan.hardware import Gpu
from megabam.plan.memory import Layout, _dtype_bytes, memory_bytes, rank_parameters

GIB = 2**30
ATTENTION_MIXERS = ("attention", "swa")  # their mixing FLOPs are the `attention` kind; each other mixer's its own


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]
    capacity: float
    communication: dict[str, float]  # bytes per rank per step
    times: dict[str, float]  # seconds per step
    tokens_per_s: float
    mfu: float
    flops_per_token: float  # training, with the layout's recomputation
    work: dict[str, float]  # roofline seconds per step by kind (calibration.KINDS), before the bubble
    calibrated_tokens_per_s: float | None = None  # with the GPU's measured efficiencies, where there are
    calibrated_mfu: float | None = None

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.capacity

    @property
    def margin(self) -> float:
        return self.capacity - self.memory["total"]


def config_layout(cfg: Config, world: int) -> Layout:
    p = cfg.parallel
    return Layout(
        tensor=p.tensor,
        pipeline=p.pipeline,
        data=world // (p.tensor * p.pipeline),
        zero_stage=p.zero_stage,
        recompute=p.recompute,
        micro_batch=cfg.train.micro_batch_size,
        grad_accum=cfg.train.grad_accum,
        sequence_parallel=p.sequence_parallel,
    )


def with_layout(cfg: Config, layout: Layout) -> Config:
    """`cfg` at `layout`, through every rule of the config (raises ConfigError where one fails)."""
    raw = dataclasses.asdict(cfg)
    raw["parallel"].update(
        tensor=layout.tensor,
        pipeline=layout.pipeline,
        data=0,
        zero_stage=layout.zero_stage,
        recompute=layout.recompute,
        sequence_parallel=layout.sequence_parallel,
        pipeline_boundaries=cfg.parallel.pipeline_boundaries if layout.pipeline == cfg.parallel.pipeline else [],
    )
    raw["train"].update(micro_batch_size=layout.micro_batch, grad_accum=layout.grad_accum)
    return config_from_dict(raw, "<plan>")


def kind_of(component: str) -> str:
    """The kind of work (calibration.KINDS) of a forward-FLOPs component: a mixer's own part
    (`<mixer>.<part>`) is attention or that mixer's cell, every other component a weight's matmul."""
    mixer, _, part = component.partition(".")
    if not part:
        return "matmul"
    return "attention" if mixer in ATTENTION_MIXERS else mixer


def estimate(
    cfg: Config, model: Decoder, layout: Layout, gpu: Gpu, gpus_per_node: int, calibration: Calibration | None = None
) -> Estimate:
    b = _dtype_bytes(cfg)
    t, pp, dp = layout.tensor, layout.pipeline, layout.data
    forward = forward_flops_by_component(model, cfg.data.seq_len, window_draws(cfg))
    model_flops = 3 * sum(forward.values())
    hardware_flops = model_flops + recompute_share(layout.recompute, cfg.parallel.recompute_mixers, forward)
    tokens_micro = layout.micro_batch * cfg.data.seq_len
    micro_batches = layout.grad_accum
    memory = memory_bytes(cfg, model, layout)
    psi, stage_blocks = rank_parameters(model, layout)

    at_peak = tokens_micro * micro_batches / (t * pp) / (gpu.peak_tflops * 1e12)  # FLOPs per token → seconds
    work = {}
    for kind in sorted({kind_of(k) for k in forward}):
        part = {k: v for k, v in forward.items() if kind_of(k) == kind}
        recomputed = recompute_share(layout.recompute, cfg.parallel.recompute_mixers, part)
        work[kind] = (3 * sum(part.values()) + recomputed) * at_peak
    compute = sum(work.values())
    bandwidth = gpu.hbm_gbps * 1e9
    work["elementwise"] = micro_batches * (3 * psi * b + 2 * memory["activations"] / max(1, min(pp, micro_batches)))
    work["elementwise"] /= bandwidth
    work["optimizer"] = psi * (b + 2 * 16 / dp) / bandwidth  # weights written, partition read and written
    hbm = work["elementwise"] + work["optimizer"]
    bubble = (micro_batches + pp - 1) / micro_batches
    busy = (compute + hbm) * bubble  # matmuls at their FLOP bound, then the elementwise passes at their byte bound

    h = cfg.model.d_model
    message = tokens_micro * h * b
    collectives = 4 + (2 if layout.recompute == "full" else 0)
    tp_bytes = micro_batches * stage_blocks * collectives * 2 * (t - 1) / t * message if t > 1 else 0.0
    within_node = t * pp <= gpus_per_node
    tp_bw = gpu.nvlink_gbps if t <= gpus_per_node else gpu.network_gbps
    pp_bytes = micro_batches * 2 * message / (t if layout.sequence_parallel else 1) if pp > 1 else 0.0
    pp_bw = gpu.nvlink_gbps if within_node else gpu.network_gbps
    dp_bytes = 2 * psi * b * (dp - 1) / dp if dp > 1 else 0.0  # reduce-scatter + all-gather (or all-reduce)
    dp_bw = gpu.nvlink_gbps if t * pp * dp <= gpus_per_node else gpu.network_gbps
    times = {
        "compute": compute,
        "hbm": hbm,
        "bubble": (compute + hbm) * (bubble - 1),
        "tensor_parallel": tp_bytes / (tp_bw * 1e9),
        "pipeline_sends": pp_bytes / (pp_bw * 1e9),
        "data_parallel": dp_bytes / (dp_bw * 1e9),
    }
    communication = times["tensor_parallel"] + times["pipeline_sends"] + times["data_parallel"]
    times["step"] = busy + communication
    tokens_per_step = tokens_micro * micro_batches * dp

    def mfu(tokens_per_s: float) -> float:
        return model_flops * tokens_per_s / (layout.world * gpu.peak_tflops * 1e12)

    calibrated = None
    if calibration is not None and not calibration.missing(work):
        calibrated = tokens_per_step / (calibration.step_seconds(work) * bubble + communication)
    return Estimate(
        layout=layout,
        memory=memory,
        capacity=gpu.memory_gib * GIB,
        communication={"tensor_parallel": tp_bytes, "pipeline_sends": pp_bytes, "data_parallel": dp_bytes},
        times=times,
        tokens_per_s=tokens_per_step / times["step"],
        mfu=mfu(tokens_per_step / times["step"]),
        flops_per_token=hardware_flops,
        work=work,
        calibrated_tokens_per_s=calibrated,
        calibrated_mfu=None if calibrated is None else mfu(calibrated),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: Config, world: int, gpus_per_node: int) -> list[Layout]:
    """Every layout of `world` GPUs the config's rules accept, at the config's global batch: TP within a
    node, PP dividing the rest, each recompute mode, micro-batches 1-8, SP with TP."""
    par = cfg.parallel
    own_dp = par.data or world // (par.tensor * par.pipeline)
    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum * own_dp
    found = []
    for t in _divisors(gpus_per_node):
        for pp in _divisors(world // t) if world % t == 0 else []:
            dp = world // (t * pp)
            for micro in (1, 2, 4, 8):
                if global_batch % (micro * dp):
                    continue
                for recompute in ("none", "selective", "full"):
                    for sp in (False, True) if t > 1 else (False,):
                        zero = 1 if pp > 1 else par.zero_stage
                        layout = Layout(t, pp, dp, zero, recompute, micro, global_batch // (micro * dp), sp)
                        try:
                            with_layout(cfg, layout)
                        except ConfigError:
                            continue
                        found.append(layout)
    return found


@dataclass
class Plan:
    gpu: Gpu
    nodes: int
    gpus_per_node: int
    params: dict[str, int]
    forward_flops: dict[str, float]
    model_flops: float
    own: Estimate | None
    own_problem: str | None
    best: list[Estimate]


def plan(
    cfg: Config, gpu: Gpu, nodes: int, gpus_per_node: int, top: int = 5, calibration: Calibration | None = None
) -> Plan:
    model = meta_model(cfg)
    world = nodes * gpus_per_node
    forward = forward_flops_by_component(model, cfg.data.seq_len, window_draws(cfg))
    own, problem = None, None
    par = cfg.parallel
    if world % (par.tensor * par.pipeline) or (par.data and par.data * par.tensor * par.pipeline != world):
        layout = f"TP{par.tensor} PP{par.pipeline}, data {par.data or 'any'}"
        problem = f"the config's layout ({layout}) does not fill {world} GPUs"
    else:
        own = estimate(cfg, model, config_layout(cfg, world), gpu, gpus_per_node, calibration)
    estimates = [
        estimate(cfg, model, lay, gpu, gpus_per_node, calibration)
        for lay in candidate_layouts(cfg, world, gpus_per_node)
    ]
    best = sorted((e for e in estimates if e.fits), key=lambda e: -e.tokens_per_s)[:top]
    return Plan(
        gpu, nodes, gpus_per_node, params_by_component(model), forward, 3 * sum(forward.values()), own, problem, best
    )
