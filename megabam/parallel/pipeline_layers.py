"""The layers of megabam's pipeline in DeepSpeed's order, named as the `Decoder` names them.

build_pipeline (megabam/parallel/pipeline.py) lays the model out in this order, and DeepSpeed saves
layer i of it in its own file (megabam/checkpoint/shards.py names them); the checkpoint reader finds
a tensor's file through the same list, without importing DeepSpeed.
"""

TIED_HEAD = "tied head"  # the last stage's use of the tied embedding: DeepSpeed saves no file for it
EMBEDDING_KEY = "embedding"  # the TiedLayerSpec key of the tied embedding: its stages name it tied_modules.embedding.*


def pipeline_layers(n_blocks: int, tied: bool) -> list[str]:
    """The Decoder prefix each pipeline layer holds: the embedding, every block, the final norm, the head."""
    return ["embed", *(f"blocks.{i}" for i in range(n_blocks)), "norm", TIED_HEAD if tied else "lm_head"]


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
