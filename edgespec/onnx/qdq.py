"""The QDQ form of an ONNX export (``edgespec export-onnx --weights qdq``): the
graph NPU execution providers (QNN's HTP, and others compiling quantized
graphs) take as it is.

NPU providers run integer arithmetic and reject float MatMul and Gather; they
read a quantized graph in QDQ form: every operator between DequantizeLinear
nodes on its inputs and QuantizeLinear nodes on its output, the scales fixed
in the graph. So the QDQ form is the static-shape float graph (plain operators
only: no contrib ops, see edgespec.onnx.export) calibrated and quantized by ONNX
Runtime's own quantizer with its QNN settings:

    weights       int8, symmetric, one scale per output channel (DequantizeLinear -> MatMul / Gemm / Gather)
    activations   uint16 with one scale and zero point per tensor, from the ranges
                  seen on CALIBRATION_TEXT (A16W8: 8-bit activations lose too
                  much in a language model's residual stream and logits)

Calibration runs the float graph through the onnx backend itself (its own
calls: padded to the fixed width, over the float16 cache), recording every
call's inputs, so the ranges are those of real decoding. Quantization is not
exact: the QDQ graph's logits differ from the float graph's (see
benchmarks/bench_onnx.py --weights qdq for the figures); it is the form for
providers that need it, the int4 form (MatMulNBits) stays the CPU's.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from ..errors import ModelFormatError
from ..files import atomic_output

# Decoded once through the float graph to calibrate the activation ranges:
# prose, code and a chat turn, like what the models are asked.
CALIBRATION_TEXT = (
    "<|im_start|>user\nWrite a function that returns the n-th Fibonacci number.<|im_end|>\n"
    "<|im_start|>assistant\n"
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press. Within fifty "
    "years presses were at work in more than two hundred cities across Europe, and the "
    "price of a book fell to a fraction of what a copied manuscript had cost. "
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10. The capital of France is Paris; of Italy, Rome."
)
CALIBRATION_TOKENS = 192      # at most this many tokens (12 static calls) are decoded


def calibration_feeds(folder: Path, threads: int | None = None) -> list[dict]:
    """Every call's inputs (the cache included, as it was before the call) while
    the float export in ``folder`` decodes CALIBRATION_TEXT."""
    from ..backends.onnx import OnnxBackend

    backend = OnnxBackend(folder, threads=threads)
    try:
        tokens = backend.tokenize(CALIBRATION_TEXT)[:CALIBRATION_TOKENS]
        backend.recorded = []
        for start in range(0, len(tokens), backend.n_ctx):  # in windows of the context, if it is smaller
            backend.clear()
            backend.decode(tokens[start:start + backend.n_ctx])
        return backend.recorded
    finally:
        backend.close()


def per_channel_weights(model) -> dict[str, list[dict]]:
    """The quantizer's overrides giving each weight matrix one scale per output
    channel (its per_channel option leaves MatMul per tensor, far too coarse
    for a fused QKV or FFN matrix): axis 1 of a MatMul's (K, N) weight. (The
    embedding table stays per tensor: the rows Gather takes keep the table's
    quantization, which must be one scale for them all.)"""
    from onnxruntime.quantization import QuantType

    names = {i.name for i in model.graph.initializer}
    overrides = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in names:
            overrides[node.input[1]] = [{"quant_type": QuantType.QInt8, "symmetric": True, "axis": 1}]
    return overrides


@contextlib.contextmanager
def _quiet():
    """The quantizer's advice (logging warnings) and its sessions' warnings unsaid."""
    import onnxruntime as ort

    logging.disable(logging.WARNING)
    ort.set_default_logger_severity(3)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
        ort.set_default_logger_severity(2)


def quantize_export(folder: Path, model_file: str, threads: int | None = None) -> None:
    """Replace the float static graph ``folder/model_file`` (an export of
    weights "qdq", not yet quantized) by its QDQ form, calibrated here."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    path = folder / model_file
    # the quantizer calibrates the tensors whose types it knows: every one, inferred
    onnx.shape_inference.infer_shapes_path(str(path), str(path))
    feeds = calibration_feeds(folder, threads)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._feeds = iter(feeds)

        def get_next(self):
            return next(self._feeds, None)

    config = get_qnn_qdq_config(str(path), Reader(), activation_type=QuantType.QUInt16,
                                weight_type=QuantType.QInt8, per_channel=True, weight_symmetric=True,
                                init_overrides=per_channel_weights(onnx.load(str(path), load_external_data=False)))
    try:
        with _quiet(), atomic_output(path) as out:   # the QDQ graph replaces the float one whole
            quantize(str(path), str(out), config)
    except Exception as e:
        raise ModelFormatError(f"onnxruntime's quantizer could not make the QDQ form: "
                               f"{str(e).strip().splitlines()[0]}") from e
