"""The layers of megabam's pipeline in DeepSpeed's order, named as the `Decoder` names them.

build_pipeline (megabam/parallel/pipeline.py) lays the model out in this order, and DeepSpeed saves
layer i of it as `layer_{i:02d}-model_{tp:02d}-model_states.pt`; checkpoint conversion reads those
files through the same list, without importing DeepSpeed.
"""

TIED_HEAD = "tied head"  # the last stage's use of the tied embedding: DeepSpeed saves no file for it


def pipeline_layers(n_blocks: int, tied: bool) -> list[str]:
    """The Decoder prefix each pipeline layer holds: the embedding, every block, the final norm, the head."""
    return ["embed", *(f"blocks.{i}" for i in range(n_blocks)), "norm", TIED_HEAD if tied else "lm_head"]


def layer_file(layer: int, tp_rank: int) -> str:
    """DeepSpeed's file of pipeline layer `layer` on tensor rank `tp_rank` (PipelineModule.ckpt_layer_path)."""
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def locate(name: str, layers: list[str]) -> tuple[int, str]:
    """(layer index, key in that layer's file) of the Decoder tensor `name`: a block is saved as its
    BlockStage, whose own name for it is `block`."""
    for index, prefix in enumerate(layers):
        if name.startswith(prefix + "."):
            return index, ("block" + name[len(prefix) :]) if prefix.startswith("blocks.") else name
    raise KeyError(f"{name} belongs to no pipeline layer")
