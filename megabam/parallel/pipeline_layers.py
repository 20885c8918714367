"""The layers of megabam's pipeline in DeepSpeed's order, named as the `Decoder` names them, and the
identity each weights file records.

build_pipeline (megabam/parallel/pipeline.py) lays the model out in this order, and DeepSpeed saves
layer i of it as `layer_{i:02d}-model_{tp:02d}-model_states.pt`; checkpoint conversion reads those
files through the same list, without importing DeepSpeed.

Every weights file also records which rank of which layout wrote it (`SHARD_KEY`): a file copied
over another tensor rank's, or another layer's, holds tensors of the right names and shapes and
would otherwise load, or merge, into wrong weights without a word.
"""

TIED_HEAD = "tied head"  # the last stage's use of the tied embedding: DeepSpeed saves no file for it
EMBEDDING_KEY = "embedding"  # the TiedLayerSpec key of the tied embedding: its stages name it tied_modules.embedding.*


SHARD_KEY = "megabam_shard"


def shard_identity(tensor_rank: int, tensor: int, pipeline: int, layer: int | None = None) -> dict:
    """What a weights file records of its writer: its tensor rank, the layout, and (a pipeline
    layer's file) the layer."""
    identity = {"tensor_rank": tensor_rank, "tensor": tensor, "pipeline": pipeline}
    return identity if layer is None else {**identity, "layer": layer}


def identity_problem(recorded, expected: dict) -> str | None:
    """Why a file recording `recorded` cannot stand where `expected` belongs; None when it can (or
    records nothing: checkpoints written before the record)."""
    if not recorded or recorded == expected:
        return None
    return f"written as {_described(recorded)}, not {_described(expected)} (a file copied over another?)"


def _described(identity) -> str:
    if not isinstance(identity, dict):
        return repr(identity)[:80]
    get = identity.get
    where = f"layer {get('layer')} of " if "layer" in identity else ""
    return f"{where}tensor rank {get('tensor_rank')} of a tensor={get('tensor')}, pipeline={get('pipeline')} layout"


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


def decoder_name(stage_name: str, layers: list[str] | None) -> str:
    """The Decoder's name of a parameter as a stage module names it (DeepSpeed's optimizer files use
    these): `i.<key>` is layer i's tensor `key` (the inverse of `locate`), `tied_modules.embedding.*`
    the tied embedding on either stage that holds it. Without a pipeline (`layers` None) the names are
    the Decoder's already."""
    if layers is None:
        return stage_name
    tied = f"tied_modules.{EMBEDDING_KEY}."
    if stage_name.startswith(tied):
        return stage_name[len(tied) :]
    index, key = stage_name.split(".", 1)
    prefix = layers[int(index)]
    return prefix + key[len("block") :] if prefix.startswith("blocks.") else key
