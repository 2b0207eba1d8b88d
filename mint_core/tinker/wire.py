"""The protobuf bodies of Tinker's API, read and written with the SDK's own generated classes.

The SDK sends `forward_backward` (and `forward`) as a `ForwardBackwardRequest` protobuf (zstd-compressed when the
server's client config asks for it), and asks for `ForwardBackwardOutput` and `SampleResponse` results as protobuf
(`Accept: application/x-protobuf`); everything else is JSON of `tinker.types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

PROTO = "application/x-protobuf"

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


class WireError(ValueError):
    """A request body that cannot be read; the message says what is wrong."""


@dataclass
class Datum:
    """One example of a forward_backward call: its input tokens and its loss inputs, each a 1-D or N-D array."""

    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


def _tensor(name: str, msg: pb.Tensor) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise WireError(
            f"loss_fn_inputs[{name!r}]: sparse tensors are not supported by this server; send it dense"
        )
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    if len(msg.dense) % dtype.itemsize:
        raise WireError(f"loss_fn_inputs[{name!r}]: {len(msg.dense)} bytes is not a whole number of {dtype}")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {arr.size} values")
    arr = arr.reshape(shape)
    return arr.astype(np.int64) if dtype.kind == "i" else arr


def read_forward_backward(body: bytes, zstd: bool = False) -> ForwardBackward:
    """A `ForwardBackwardRequest` body as plain arrays; WireError naming what cannot be read."""
    if zstd:
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
        except zstandard.ZstdError as e:
            raise WireError(f"the zstd body cannot be decompressed: {e}") from None
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {e}") from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 carries strings too
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[np.ndarray] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(
                    f"datum {i}: {kind} chunks are not supported by this server (text tokens only)"
                )
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise WireError(f"datum {i}: token bytes are not int32")
            tokens.append(np.frombuffer(raw, dtype=np.int32).astype(np.int64))
        ids = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
        data.append(Datum(ids, {name: _tensor(name, t) for name, t in d.loss_fn_inputs.items()}))
    return ForwardBackward(msg.model_id, int(msg.seq_id), msg.loss_fn, config, data, bool(msg.forward_only))


def write_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one ArrayRecord with each output field batched over the data (1-D per datum)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    for name in outputs[0] if outputs else []:
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None
    stop: bool  # ended on a stop condition (else: max_tokens)


def write_sample_response(sequences: list[Sampled], prompt_logprobs: list[float | None] | None) -> bytes:
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        if s.logprobs is not None:
            seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        vals = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(vals, dtype=np.float32).tobytes()
    return msg.SerializeToString()
