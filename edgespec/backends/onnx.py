"""ONNX Runtime backend: a decoder graph from ``edgespec export-onnx`` on an
execution provider (CPU, or an NPU/GPU through QNN, OpenVINO, DirectML, CoreML, CUDA).

The KV cache is one (1, n_head_kv, slots, head_dim) array per layer and kind
(float32 for the dynamic graph, float16 for a static one), allocated once and
bound through IO binding as both the graph's ``past.*`` input and its
``present.*`` output: a call writes only its new rows, in place, and rolling
back is forgetting slots (the next call writes them again; the mask hides them
until then). Every call passes an additive attention mask, so a draft tree is
one call: each node sees the cache, the prefix and its own ancestors. Logits
land in a bound float32 buffer per row count; callers get the address of the
wanted rows, alive until the next call.

Tokenizer, metadata and chat template come from the source GGUF through
llama.cpp's vocabulary (edgespec.backends.vocab), token for token the llama
backend's.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..models import registry
from ..config import DEFAULT_BATCH
from ..errors import BackendError, InvalidArgumentError, ModelFormatError
from .base import Backend, context_size, default_threads
from .vocab import Vocab, VocabMixin

# --ep name -> ONNX Runtime execution provider
PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
}
# Providers shipped as plugin libraries (ONNX Runtime's plugin EP interface):
# --ep name -> (Python package, what it loads)
PLUGINS = {"qnn": "onnxruntime_qnn"}
MASKED = np.float32(-np.inf)
# The QDQ form's mask: finite, since the sum of scores and mask is quantized
# with a range calibrated on it (-inf has none); exp(-100) is 0 in float32
# beside any unmasked score.
MASKED_QDQ = np.float32(-100.0)
KEPT_LOGITS_ROWS = 32  # output buffers kept for calls of up to this many logits rows


def provider(ep: str) -> tuple[str, dict]:
    """The installed ONNX Runtime provider for ``--ep`` (``name`` or
    ``name:DEVICE``, e.g. openvino:NPU) and its options; a clear error otherwise."""
    import onnxruntime as ort

    name, _, device = ep.partition(":")
    if name not in PROVIDERS:
        raise InvalidArgumentError(f"unknown execution provider '{name}' (known: {', '.join(PROVIDERS)})")
    if device and name != "openvino":
        raise InvalidArgumentError(f"--ep {ep}: a device is chosen for openvino only (openvino:CPU, NPU, GPU)")
    if device and not re.fullmatch(r"(CPU|GPU|NPU)(\.\d+)?", device.upper()):
        raise InvalidArgumentError(f"unknown OpenVINO device '{device}' (CPU, GPU or NPU, e.g. openvino:NPU)")
    installed = ort.get_available_providers()
    if PROVIDERS[name] not in installed and name in PLUGINS:
        installed = _register_plugin(name)
    if PROVIDERS[name] not in installed:
        for plugin in PLUGINS:  # list the plugin providers that are installed too
            installed = _register_plugin(plugin)
        have = [n for n, p in PROVIDERS.items() if p in installed]
        raise InvalidArgumentError(
            f"execution provider '{name}' ({PROVIDERS[name]}) is not in this onnxruntime build; "
            f"available: {', '.join(have)} (install the onnxruntime package built for it, "
            "e.g. onnxruntime-qnn, onnxruntime-openvino, onnxruntime-directml, onnxruntime-gpu)")
    options = {"device_type": device.upper()} if device else {}
    if name == "qnn":  # the HTP backend (the NPU; on x86 the SDK's emulation of it)
        options["backend_path"] = __import__(PLUGINS[name]).get_qnn_htp_path()
    if name == "openvino" and options.get("device_type", "CPU") == "CPU":
        options["precision"] = "FP32"  # OpenVINO's CPU device may otherwise run in bf16
    return PROVIDERS[name], options


def _register_plugin(name: str) -> list[str]:
    """Register the plugin provider ``name`` with ONNX Runtime when its package
    is installed (once per process); the providers available after that."""
    import onnxruntime as ort

    try:
        package = __import__(PLUGINS[name])
    except ImportError:
        return ort.get_available_providers()
    if package.get_ep_name() not in ort.get_available_providers():
        try:
            ort.register_execution_provider_library(package.get_ep_name(), package.get_library_path())
        except Exception as e:
            raise BackendError(f"execution provider '{name}' ({PLUGINS[name]}) is installed but "
                               f"could not be loaded: {_first_line(e)}") from e
    return ort.get_available_providers()


@contextlib.contextmanager
def _no_stdout(enabled: bool = True):
    """Drop what native code writes to stdout (file descriptor 1) meanwhile."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def session(path: Path, ep: str, threads: int, *, verbose: bool = False, optimize: bool = True):
    """An InferenceSession of ``path`` on ``ep`` (falling back to the CPU for
    the nodes the provider leaves). A provider that is installed but cannot
    open its device is a BackendError saying so, in one line (ONNX Runtime
    itself would only warn and run everything on the CPU)."""
    import onnxruntime as ort

    name, options = provider(ep)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 0 if verbose else 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if not verbose:
        ort.set_default_logger_severity(4)  # a provider failing to start logs before it falls back
    providers = [(name, options)] + ([("CPUExecutionProvider", {})] if name != "CPUExecutionProvider" else [])
    plugin = [d for d in ort.get_ep_devices() if d.ep_name == name and d.ep_name != "CPUExecutionProvider"]
    if plugin:  # a plugin library's provider is chosen by device, the CPU provider taking the rest
        opts.add_provider_for_devices(plugin, options)
        providers = None
    try:
        with _no_stdout(enabled=bool(plugin)):  # QNN's libraries print a line as they load
            sess = ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:
        raise BackendError(f"onnxruntime could not load {path} on {ep}: {_first_line(e)}") from e
    if name not in sess.get_providers():
        device = f" device {options['device_type']}" if "device_type" in options else " device"
        devices = getattr(ort.capi._pybind_state, "get_available_openvino_device_ids", None)
        have = f" (devices here: {', '.join(devices())})" if devices and name == "OpenVINOExecutionProvider" else ""
        raise BackendError(f"execution provider '{ep}' is installed but could not open its{device}{have}")
    return sess


def placement(path: Path, ep: str, threads: int = 1) -> dict:
    """Where the nodes of the graph at ``path`` run on ``ep``, from ONNX
    Runtime's own node placement report (graph optimizations off, so that the
    nodes are the exported ones): {"provider", "nodes" (in the graph),
    "on_provider", "fallback": [(node name, operator), ...] left to the CPU,
    "boundary": those of them that only quantize a graph input or dequantize a
    graph output (a QDQ graph on an integer provider: ONNX Runtime converts at
    the boundary, as QNN's provider expects)}."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    io = {v.name for v in graph.input} | {v.name for v in graph.output}
    edges = {n.name: (n.op_type, set(n.input) | set(n.output)) for n in graph.node}
    name, _ = provider(ep)
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(2)
        try:
            sys.stderr.flush()
            os.dup2(log.fileno(), 2)
            session(path, ep, threads, verbose=True, optimize=False)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = log.read().splitlines()
    fallback, section = [], None
    for line in lines:
        if "Node(s) placed on [" in line:
            section = line.split("[", 2)[2].split("]")[0]
        elif section and "VerifyEachNodeIsAssignedToAnEp]   " in line:
            op, _, node = line.split("]   ", 1)[1].partition(" (")
            if section == "CPUExecutionProvider" and name != section:
                fallback.append((node.rstrip(")"), op))
        elif section:
            section = None if "VerifyEachNodeIsAssignedToAnEp" not in line else section
    boundary = [(node, op) for node, op in fallback if op in ("QuantizeLinear", "DequantizeLinear")
                and edges.get(node, ("", set()))[1] & io]
    return {"provider": name, "nodes": len(graph.node), "on_provider": len(graph.node) - len(fallback),
            "fallback": [f for f in fallback if f not in boundary], "boundary": boundary}


FORMAT = "edgespec-onnx"
FORMAT_VERSION = 3             # 3: GroupQueryAttention over a cache the caller owns (IO binding)
CONFIG_FILE = "edgespec-onnx.json"
MODEL_FILE = "model.onnx"


def load_export(folder: str | os.PathLike) -> dict:
    """The config of an exported folder; ModelFormatError when it is not one."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{folder} is not an edgespec ONNX export (no {CONFIG_FILE}; "
                               "make one with `edgespec export-onnx MODEL OUT_DIR`)") from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{folder / CONFIG_FILE}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelFormatError(f"{folder / CONFIG_FILE} is not an edgespec ONNX export config")
    if meta.get("version") != FORMAT_VERSION:
        raise ModelFormatError(f"{folder} was exported in format version {meta.get('version')}; "
                               f"this edgespec reads version {FORMAT_VERSION} (export it again)")
    if not (folder / meta.get("model", MODEL_FILE)).is_file():
        raise ModelFormatError(f"{folder} has no {meta.get('model', MODEL_FILE)}")
    return meta


class OnnxBackend(VocabMixin, Backend):
    name = "onnx"
    # A tree node sits after the slots of its earlier siblings' branches, masked
    # out; ONNX Runtime's softmax and attention sums run over SIMD lanes, so
    # those holes move the node's keys between lanes and round its row
    # differently from the same token in a chain. The engine verifies a tree
    # drafter's first path as a chain instead.
    exact_trees = False
    _session = _io = None
    vocab = None
    recorded: list[dict] | None = None  # a list: every call's inputs are appended to it

    def __init__(self, path: Path, *, n_ctx: int | None = None, n_batch: int = DEFAULT_BATCH,
                 threads: int | None = None, ep: str | None = None, n_seq: int = 1, verbose: bool = False):
        # n_seq does not apply: trees are verified along their first path (exact_trees False).
        import onnxruntime as ort

        super().__init__()
        self.ep = ep = ep or "cpu"
        provider(ep)  # before reading anything
        self.folder = Path(path)
        meta = load_export(self.folder)
        cfg = meta["config"]
        self.path = self.folder / meta["model"]
        self.weights = meta["weights"]
        self._masked = MASKED_QDQ if self.weights == "qdq" else MASKED
        source = Path(meta["source"]["gguf"])
        if not source.is_file():
            raise ModelFormatError(f"{self.folder}: its source GGUF {source} (tokenizer and metadata) "
                                   "is missing; export the model again")
        self.gguf_path = source
        self.vocab = Vocab.load(source, verbose=verbose)
        self.n_vocab = cfg["n_vocab"]
        if self.vocab.n_vocab != self.n_vocab:
            raise ModelFormatError(f"{self.folder}: the graph has {self.n_vocab} logits but its source GGUF "
                                   f"{self.vocab.n_vocab} tokens; export the model again")
        self.n_ctx_train = cfg["n_ctx_train"]
        self.threads = threads or default_threads()
        self.n_layer = cfg["n_layer"]
        self.static = meta["static"]
        self._n_swa = cfg["n_swa"] if cfg.get("swa_layers") and any(cfg["swa_layers"]) else 0
        if self.static:
            # Fixed shapes: calls of `seq` tokens (padded), a cache of `ctx` slots of
            # which the last `seq` take a call's padding.
            self._chunk = self.static["seq"]
            self.n_ctx = context_size(n_ctx, self.static["ctx"] - self._chunk, extend=None,
                                      limit_name="the static graph's cache")
            slots, cache_type = self.static["ctx"], np.float16
        else:
            # The graph's RoPE tables cover `positions`; one slot more than the
            # context takes the copy of a call's last row (see edgespec.onnx.export).
            self.n_ctx = context_size(n_ctx, min(self.n_ctx_train, meta["positions"]), extend=None)
            slots, cache_type = self.n_ctx + 1, np.float32
        self.n_batch = min(n_batch, self.n_ctx)
        if not self.static:
            self._chunk = self.n_batch

        try:
            self._session = session(self.path, ep, self.threads, verbose=verbose)
        except BaseException:
            self.close()
            raise
        if self.static:
            self._check_static_shapes(cfg)
        # The KV cache: one buffer per layer and kind, bound once as both the
        # graph's past input and its present output, so that a call writes only
        # its new rows in place (the caller-owned memory ORT runs on).
        self._io = self._session.io_binding()
        self._cache = []  # (1, n_head_kv, slots, head_dim) arrays the OrtValues wrap
        self._past = [f"past.{i}.{kind}" for i in range(self.n_layer) for kind in ("key", "value")]
        for i in range(self.n_layer):
            for kind in ("key", "value"):
                array = np.zeros((1, cfg["n_head_kv"], slots, cfg["head_dim"]), dtype=cache_type)
                value = ort.OrtValue.ortvalue_from_numpy(array)
                self._cache.append(array)
                self._io.bind_ortvalue_input(f"past.{i}.{kind}", value)
                self._io.bind_ortvalue_output(f"present.{i}.{kind}", value)
        self._slot_pos = np.zeros(slots, dtype=np.int64)  # the position each cache slot holds
        self._logits_bufs: dict[int, tuple[np.ndarray, object]] = {}
        self._n = 0  # cache slots written

    def speed_variant(self) -> tuple[str, str]:
        return f"@{self.ep}", ""

    def _check_static_shapes(self, cfg: dict) -> None:
        """A static graph whose inputs are not the shapes its config names (a
        model.onnx exported for another call shape) is refused with both."""
        want = {"attention_bias": [1, 1, self.static["seq"], self.static["ctx"]],
                "past.0.key": [1, cfg["n_head_kv"], self.static["ctx"], cfg["head_dim"]]}
        have = {i.name: i.shape for i in self._session.get_inputs() if i.name in want}
        if have != want:
            self.close()
            raise ModelFormatError(f"{self.path}: the graph takes {have}, but {CONFIG_FILE} "
                                   f"says calls of {self.static['seq']} tokens over {self.static['ctx']} "
                                   f"cache slots {want}; export the model again")

    # -- evaluation ---------------------------------------------------------

    def _forward(self, tokens: list[int], positions: list[int], bias: np.ndarray, first_row: int) -> int:
        """Evaluate ``tokens`` into cache slots n_past... under ``bias`` (n, n_past + n):
        row i may attend to the slots where it is 0. Runs in chunks (n_batch
        tokens, or the static graph's fixed width, padded); keeps the logits of
        rows >= first_row, C-contiguous float32 (n - first_row, n_vocab), alive
        until the next call, and returns their address (the bound output
        buffer itself for a one-chunk call of the dynamic graph)."""
        start, n = self._n, len(tokens)
        kept = []
        for a in range(0, n, self._chunk):
            b = min(a + self._chunk, n)
            rows = np.arange(max(first_row - a, 0), b - a, dtype=np.int64)
            if len(rows) == 0:
                rows = np.array([b - a - 1], dtype=np.int64)  # a chunk before the wanted rows
            logits = self._run(tokens[a:b], positions[a:b], bias[a:b, :start + b], rows, start + a)
            if b > first_row:  # a later chunk may reuse the buffer: keep a copy
                kept.append(logits if b == n else logits.copy())
        self._logits = kept[0] if len(kept) == 1 else np.concatenate(kept)
        return self._logits.ctypes.data

    def _logits_buffer(self, n_rows: int) -> np.ndarray:
        """The (1, n_rows, n_vocab) float32 output buffer for calls with n_rows rows, bound."""
        import onnxruntime as ort

        if n_rows in self._logits_bufs:
            array, value = self._logits_bufs[n_rows]
        else:
            array = np.empty((1, n_rows, self.n_vocab), dtype=np.float32)
            value = ort.OrtValue.ortvalue_from_numpy(array)
            if n_rows <= KEPT_LOGITS_ROWS:  # the row counts of plain and verification steps
                self._logits_bufs[n_rows] = (array, value)
        self._io.bind_ortvalue_output("logits", value)
        return array

    def _feeds(self, tokens, positions, bias: np.ndarray, rows: np.ndarray,
               first_slot: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The inputs of one graph call for m tokens written to slots
        first_slot... (the cache aside, which is bound once), and for a static
        graph the logits rows wanted out of its fixed-width output."""
        m = len(tokens)
        self._slot_pos[first_slot:first_slot + m] = positions
        feeds, wanted = {}, None
        if self.static:  # pad to the fixed width; a padding row sees only its own slot
            width, size = self._chunk, len(self._slot_pos)
            tokens = list(tokens) + [0] * (width - m)
            positions = list(positions) + [positions[-1]] * (width - m)
            full = np.full((width, size), self._masked, dtype=np.float32)
            full[:m, :bias.shape[1]] = bias
            slots = np.arange(first_slot, first_slot + width, dtype=np.int64)
            full[np.arange(m, width), slots[m:]] = 0
            self._slot_pos[slots[m:]] = positions[-1]
            bias, wanted, rows = full, rows, np.arange(width, dtype=np.int64)
            feeds["cache_slots"] = slots
            seen = self._slot_pos[:size]
        else:  # one column more: the slot of the graph's copy of the last row
            bias = np.concatenate([bias, np.full((m, 1), self._masked, dtype=np.float32)], axis=1)
            seen = self._slot_pos[:bias.shape[1]]
        feeds["input_ids"] = np.asarray(tokens, dtype=np.int64)[None]
        feeds["position_ids"] = np.asarray(positions, dtype=np.int64)[None]
        feeds["attention_bias"] = bias[None, None]
        feeds["logits_rows"] = rows
        if self._n_swa:  # sliding-window layers: a token sees the positions p - n_swa < q <= p
            far = np.asarray(positions, dtype=np.int64)[:, None] - seen[None, :] >= self._n_swa
            feeds["attention_bias_local"] = np.where(far, self._masked, bias)[None, None]
        return {name: np.ascontiguousarray(array) for name, array in feeds.items()}, wanted

    def _run(self, tokens, positions, bias: np.ndarray, rows: np.ndarray, first_slot: int) -> np.ndarray:
        """One graph call for m tokens written to slots first_slot...; returns
        their logits rows ``rows`` (len(rows), n_vocab)."""
        feeds, wanted = self._feeds(tokens, positions, bias, rows, first_slot)  # alive during the run
        if self.recorded is not None:  # calibration (edgespec.onnx.qdq): every input, the cache as it was
            self.recorded.append({**feeds, **{name: array.copy() for name, array in zip(self._past, self._cache)}})
        for name, array in feeds.items():
            self._io.bind_cpu_input(name, array)
        out = self._logits_buffer(len(feeds["logits_rows"]))
        try:
            self._session.run_with_iobinding(self._io)
        except Exception as e:
            raise BackendError(f"onnxruntime failed: {str(e).strip().splitlines()[0]}") from e
        self._n = first_slot + len(tokens)
        logits = out[0]                                     # (rows, n_vocab), the bound buffer
        return logits[wanted] if self.static else logits

    # -- primitives (base.Backend owns the protocol) -------------------------

    def _evaluate(self, tokens: list[int], positions: list[int], parents: list[int] | None,
                  logits_from: int) -> int:
        """One evaluation under an additive mask (n, n_past + n): token i sees
        the cache, itself and its ancestors in the batch (for a chain, every
        earlier token)."""
        n, start = len(tokens), self._n
        bias = np.zeros((n, start + n), dtype=np.float32)
        if parents is None:
            bias[:, start:] = np.triu(np.full((n, n), self._masked), 1)
        else:
            bias[:, start:] = self._masked
            for i in range(n):
                node = i
                while node >= 0:
                    bias[i, start + node] = 0
                    node = parents[node]
        return self._forward(tokens, positions, bias, logits_from)

    def _truncate(self, n_keep: int) -> None:
        """Keep the first n_keep slots: nothing moves, the slots after them are
        written again by the next call (the mask hides them until then)."""
        self._n = min(self._n, n_keep)

    def _close(self) -> None:
        self._io = self._session = None
        if self.vocab is not None:
            self.vocab.close()
            self.vocab = None


BACKEND = OnnxBackend
