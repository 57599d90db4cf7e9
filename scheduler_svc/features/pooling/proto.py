"""Edge conversion of the Embed RPC (protobuf <-> embeds.py), beside the feature it serves; the
servicer calls it (api/servicer.py)."""

from __future__ import annotations

from protos import scheduler_pb2 as pb
from scheduler_svc.core.errors import ValidationError
from scheduler_svc.features.pooling.embeds import EmbedInput, EmbedResult
from scheduler_svc.features.pooling.params import PoolingType

__all__ = ["embed_input_from_proto", "embed_result_to_proto"]

_POOLING = {
    pb.POOLING_TYPE_UNSPECIFIED: None,
    pb.POOLING_TYPE_LAST: PoolingType.LAST,
    pb.POOLING_TYPE_MEAN: PoolingType.MEAN,
}


def embed_input_from_proto(request: pb.EmbedRequest, owner: str) -> EmbedInput:
    if request.pooling not in _POOLING:
        raise ValidationError(
            f"pooling must be POOLING_TYPE_LAST or POOLING_TYPE_MEAN, got {request.pooling}"
        )
    inputs: list[str | list[int]] = []
    for i, x in enumerate(request.inputs):
        kind = x.WhichOneof("input")
        if kind is None:
            raise ValidationError(f"inputs[{i}] has neither text nor token_ids")
        inputs.append(x.text if kind == "text" else list(x.token_ids.ids))
    return EmbedInput(
        inputs=inputs,
        pooling=_POOLING[request.pooling],
        normalize=request.normalize if request.HasField("normalize") else True,
        dimensions=request.dimensions if request.HasField("dimensions") else None,
        priority=request.priority,
        owner=owner,
    )


def embed_result_to_proto(result: EmbedResult) -> pb.EmbedResponse:
    return pb.EmbedResponse(
        embeddings=[
            pb.Embedding(values=v.tolist(), num_prompt_tokens=n)
            for v, n in zip(result.vectors, result.num_prompt_tokens, strict=True)
        ],
        num_prompt_tokens=sum(result.num_prompt_tokens),
    )
