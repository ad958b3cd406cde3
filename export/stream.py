"""The streaming target export: a Hugging Face folder's weights read one tensor (or a slice of
columns) at a time, transformed, quantized and appended to the bundle's data file, the graph
written node by node — so an 8B model exports in a few GB, whatever its size.

The graph is the one export/target.py traces with `--attention custom` (same nodes, same
weights, same numbers; tests/test_stream_export.py holds the two side by side), except that the
caches' capacity is a symbolic dimension (the runtime sizes them from the manifest) and an
embedding stored as bf16/fp16 stays so, widened after the Gather (exactly).

The export check runs without the model in memory: a torch reference carries random inputs
through each layer while that layer's weights are in hand (in fp32, and for a quantized graph
with the weights as the plan quantized them and int8 activations, as export/check.py does),
then ONNX Runtime runs the finished graph on the same inputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from . import ops
from .check import quantized_activations
from .sources import SourceError
from .target import store_kv_as
from .tensors import FolderTensors

ALIGN = 4096  # data file offsets: page-aligned, so ONNX Runtime can map the weights
CHUNK_VALUES = 1 << 24  # a quantized weight is read and quantized this many values of columns at a time
CHECK_CAPACITY = 16  # cache rows of the check's inputs (past 7 + 5 new rows)
TORCH_TO_ONNX = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
                 torch.float16: TensorProto.FLOAT16}
NUMPY_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
                 np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64}


class DataFile:
    """The bundle's external data file: tensors appended at aligned offsets, each a TensorProto
    that points at its bytes."""

    def __init__(self, path: Path):
        self.path, self.file = Path(path), open(path, "wb")

    def begin(self, name: str, dims, data_type: int) -> TensorProto:
        """Start a tensor whose bytes the caller then `write`s in order; `end` finishes it."""
        pad = -self.file.tell() % ALIGN
        self.file.write(b"\0" * pad)
        tensor = TensorProto(name=name, dims=list(dims), data_type=data_type,
                             data_location=TensorProto.EXTERNAL)
        tensor.external_data.add(key="location", value=self.path.name)
        tensor.external_data.add(key="offset", value=str(self.file.tell()))
        return tensor

    def write(self, data) -> None:
        self.file.write(memoryview(np.ascontiguousarray(data)).cast("B"))

    def end(self, tensor: TensorProto) -> TensorProto:
        offset = int(tensor.external_data[1].value)
        tensor.external_data.add(key="length", value=str(self.file.tell() - offset))
        return tensor

    def array(self, name: str, a) -> TensorProto:
        """A whole tensor (numpy, or torch in its own dtype)."""
        if isinstance(a, torch.Tensor):
            data_type = TORCH_TO_ONNX[a.dtype]
            a = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32).numpy()
        else:
            data_type = NUMPY_TO_ONNX[a.dtype]
        tensor = self.begin(name, a.shape, data_type)
        self.write(a)
        return self.end(tensor)

    def close(self) -> None:
        self.file.close()


class Graph:
    """Nodes and initializers, with fresh names for the values in between."""

    def __init__(self):
        self.nodes, self.initializers, self.count = [], [], 0

    def add(self, op_type: str, inputs, outputs: int | list = 1, domain: str = "", **attrs) -> list[str]:
        if isinstance(outputs, int):
            outputs = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=self.fresh(f"{op_type}_node"),
                                           domain=domain, **attrs))
        return outputs

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def constant(self, name: str, values) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(np.asarray(values), name))
        return name


class Reference:
    """The check's torch reference: the fp32 model's values, and for a quantized graph the
    values of the model with the graph's quantized weights and int8 activations."""

    def __init__(self, fp32: torch.Tensor, quantized: torch.Tensor | None):
        self.fp32, self.quantized = fp32, quantized

    def map(self, fn) -> "Reference":
        return each(fn, self)


def each(fn, *refs):
    """fn over the fp32 values of `refs` and over their quantized values: a Reference, or a tuple
    of them where fn returns a tuple."""
    fp32 = fn(*(r.fp32 for r in refs))
    quantized = None if refs[0].quantized is None else fn(*(r.quantized for r in refs))
    if not isinstance(fp32, tuple):
        return Reference(fp32, quantized)
    return tuple(Reference(a, None if quantized is None else quantized[j]) for j, a in enumerate(fp32))


def rotary_module(config):
    """transformers' own rotary module for the config (any rope scaling), without the model."""
    import importlib

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    name = min((n for n in dir(module) if n.endswith("RotaryEmbedding")), key=len)  # e.g. Qwen3RotaryEmbedding
    return getattr(module, name)(config)


class StreamExport:
    """Writes one target graph from `tensors` (FolderTensors) for `config`; `plan` quantizes its
    MatMuls (None: fp32)."""

    def __init__(self, tensors: FolderTensors, config, taps, max_len: int, folder: Path, graph_name: str,
                 plan=None, progress=print, kv_dtype: str = "fp32"):
        self.t, self.config, self.taps, self.plan = tensors, config, list(taps), plan
        self.max_len, self.progress, self.kv_dtype = max_len, progress, kv_dtype
        self.path = folder / f"{graph_name}.onnx"
        self.data = DataFile(folder / f"{graph_name}.onnx.data")
        self.g = Graph()
        self.eps = float(config.rms_norm_eps)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.shapes = {}  # Reshape targets, one initializer each

    # ---- weights ----

    def weight_names(self, i: int) -> dict:
        p = f"model.layers.{i}."
        return {"q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
                "o": p + "self_attn.o_proj", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
                "down": p + "mlp.down_proj", "input_norm": p + "input_layernorm.weight",
                "post_norm": p + "post_attention_layernorm.weight", "q_norm": p + "self_attn.q_norm.weight",
                "k_norm": p + "self_attn.k_norm.weight"}

    def check_weights(self) -> None:
        """Every weight the graph needs is in the folder (one clear error listing the missing)."""
        qwen3 = self.config.model_type == "qwen3"
        needed = ["model.embed_tokens.weight", "model.norm.weight"]
        if not getattr(self.config, "tie_word_embeddings", False):
            needed.append("lm_head.weight")
        for i in range(self.config.num_hidden_layers):
            names = self.weight_names(i)
            needed += [names[k] + ".weight" for k in ("q", "k", "v", "o", "gate", "up", "down")]
            needed += [names[k] for k in ("input_norm", "post_norm", *(("q_norm", "k_norm") if qwen3 else ()))]
        missing = [n for n in needed if n not in self.t]
        if missing:
            raise SourceError(f"{self.t.folder} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}): the weight files are incomplete or belong to "
                              "another model; copy or download the complete weight files")

    def vector(self, name: str, hf_name: str) -> tuple[str, torch.Tensor]:
        w = torch.from_numpy(self.t.get(hf_name))
        self.g.initializers.append(self.data.array(name, w.numpy()))
        return name, w

    def columns(self, parts: list[str], c0: int, c1: int) -> np.ndarray:
        """Columns c0..c1 of the fused weight [K, N] whose column blocks are the HF Linear weights
        `parts` ([out, in] each): rows of those tensors, transposed."""
        pieces, start = [], 0
        for name in parts:
            n = self.t.shape(name)[0]
            lo, hi = max(c0, start), min(c1, start + n)
            if lo < hi:
                pieces.append(self.t.get(name, rows=slice(lo - start, hi - start)))
            start += n
        return np.ascontiguousarray(np.concatenate(pieces, axis=0).T)

    def linear(self, x: str, ref: Reference, parts: list[str], base: str, lm_head: bool = False,
               output: str | None = None) -> tuple[str, Reference]:
        """x @ W (+ bias) for the fused weight of `parts` (HF names without .weight): the node
        (its output named `output`, if given), its weights written, and the reference's product."""
        names = [p + ".weight" for p in parts]
        K, N = self.t.shape(names[0])[1], sum(self.t.shape(n)[0] for n in names)
        bias_names = [p + ".bias" for p in parts]
        has_bias = any(b in self.t for b in bias_names)
        product = [output] if output and not has_bias else 1
        if self.plan is None or K % 32:
            out, ref = self.float_linear(x, ref, names, base, K, N, product)
        else:
            out, ref = self.quantized_linear(x, ref, names, base, K, N, lm_head, product)
        if has_bias:
            bias = np.concatenate([self.t.get(b) if b in self.t else np.zeros(self.t.shape(n)[0], np.float32)
                                   for b, n in zip(bias_names, names)])
            self.g.initializers.append(self.data.array(base + "_bias", bias))
            (out,) = self.g.add("Add", [out, base + "_bias"], [output] if output else 1)
            b = torch.from_numpy(bias)
            ref = ref.map(lambda h: h + b)
        return out, ref

    def float_linear(self, x, ref, names, base, K, N, product):
        """MatMul over W [K, N] in float32, written a slice of rows (the parts' columns) at a time."""
        step = max(1, CHUNK_VALUES // N)
        tensor = self.data.begin(base, [K, N], TensorProto.FLOAT)
        out = each(lambda h: torch.zeros(*h.shape[:-1], N), ref)
        for k0 in range(0, K, step):
            k = slice(k0, min(K, k0 + step))
            rows = np.ascontiguousarray(np.concatenate([self.t.get(n, rows=(slice(None), k)) for n in names]).T)
            self.data.write(rows)
            w = torch.from_numpy(rows)
            out = each(lambda o, h: o + h[..., k] @ w, out, ref)
        self.g.initializers.append(self.data.end(tensor))
        return self.g.add("MatMul", [x, base], product)[0], out

    def quantized_linear(self, x, ref, names, base, K, N, lm_head, product):
        """MatMulQ4 / MatMulQ8 of the plan's blocks, quantized a slice of columns at a time (a
        multiple of the op's 16-column tiles, so the slices' tiles concatenate to the whole)."""
        from dflash.ops.reference import Q4_TILE

        from .quantize import OPS_DOMAIN

        step = max(Q4_TILE, CHUNK_VALUES // K // Q4_TILE * Q4_TILE)
        activations = quantized_activations(ref.quantized, self.plan.split_activations).double()
        fp32_out, q_out, params, codes, kind = [], [], [], None, None
        for c0 in range(0, N, step):
            w = self.columns(names, c0, min(N, c0 + step))
            weight, kind = self.plan.quantize(w, lm_head)
            packed = weight.packed()
            if codes is None:
                kernel = "q4" if weight.bits == 4 else "q8"
                codes = self.data.begin(f"{base}_{kernel}", [-(-N // Q4_TILE), *packed[0].shape[1:]],
                                        TensorProto.UINT8)
            self.data.write(packed[0])
            params.append(packed[1:])
            fp32_out.append(ref.fp32 @ torch.from_numpy(w))
            q_out.append((activations @ torch.from_numpy(weight.dequantized()).double()).float())
        self.plan.counts[kind] += 1
        self.g.initializers.append(self.data.end(codes))
        inputs = [x, codes.name]
        for j, suffix in enumerate(["scales", "offsets"][:len(params[0])]):
            parts = [p[j] for p in params]
            # float16 where every slice holds its values exactly in it, else float32 (exact either way)
            dtype = np.float16 if all(p.dtype == np.float16 for p in parts) else np.float32
            name = f"{codes.name}_{suffix}"
            self.g.initializers.append(self.data.array(name, np.concatenate([p.astype(dtype) for p in parts])))
            inputs.append(name)
        op_type = "MatMulQ4" if codes.name.endswith("_q4") else "MatMulQ8"
        attrs = {"split_activations": 1} if self.plan.split_activations else {}
        (out,) = self.g.add(op_type, inputs, product, domain=OPS_DOMAIN, K=K, N=N, **attrs)
        return out, Reference(torch.cat(fp32_out, -1), torch.cat(q_out, -1))

    # ---- the graph ----

    def embedding(self, ids: torch.Tensor) -> tuple[str, Reference]:
        """Gather from the embedding as stored (bf16 / fp16 widened after: exact)."""
        name = "model.embed_tokens.weight"
        V, H = self.t.shape(name)
        stored = self.t.stored(name, rows=slice(0, 1)).dtype
        tensor = self.data.begin("embed_tokens", [V, H], TORCH_TO_ONNX[stored])
        step = max(1, CHUNK_VALUES // H)
        for r0 in range(0, V, step):
            rows = self.t.stored(name, rows=slice(r0, min(V, r0 + step))).contiguous()
            self.data.write(rows.view(torch.int16 if rows.element_size() == 2 else torch.int32).numpy())
        self.g.initializers.append(self.data.end(tensor))
        (x,) = self.g.add("Gather", ["embed_tokens", "input_ids"], axis=0)
        if stored != torch.float32:
            (x,) = self.g.add("Cast", [x], to=TensorProto.FLOAT)
        rows = torch.from_numpy(np.stack([self.t.get(name, rows=slice(int(i), int(i) + 1))[0]
                                          for i in ids.reshape(-1)])).reshape(*ids.shape, H)
        return x, Reference(rows, None if self.plan is None else rows.clone())

    def rms_norm(self, x, ref, weight_name, hf_name):
        name, w = self.vector(weight_name, hf_name)
        (out,) = self.g.add("SimplifiedLayerNormalization", [x, name], axis=-1, epsilon=self.eps)
        return out, ref.map(lambda h: ops.rms_norm(h, w, self.eps))

    def skip_norm(self, x, hidden, ref_x, ref_hidden, weight_name, hf_name, total_name=None):
        """(norm(x + hidden), x + hidden): the residual add and the norm after it, one node; the
        sum named `total_name` if given."""
        name, w = self.vector(weight_name, hf_name)
        outputs = [self.g.fresh("normed"), total_name or self.g.fresh("hidden")]
        out, total = self.g.add("SkipRMSNorm", [x, hidden, name], outputs, domain=ops.DFLASH_DOMAIN,
                                epsilon=self.eps)
        return (out, total, *each(lambda a, b: ops.add_rms_norm(a, b, w, self.eps), ref_x, ref_hidden))

    def shape(self, dims) -> str:
        key = tuple(dims)
        if key not in self.shapes:
            self.shapes[key] = self.g.constant(f"shape_{'_'.join(map(str, key))}", np.array(key, np.int64))
        return self.shapes[key]

    def head_norm_rotary(self, x, ref, heads, norm_name, hf_name, feeds):
        """Qwen3's per-head RMSNorm then rotary on q or k [1, S, heads*D]."""
        (x,) = self.g.add("Reshape", [x, self.shape([1, -1, heads, self.head_dim])], allowzero=1)
        name, w = self.vector(norm_name, hf_name)
        (x,) = self.g.add("SimplifiedLayerNormalization", [x, name], axis=-1, epsilon=self.eps)
        (x,) = self.g.add("Reshape", [x, self.shape([1, -1, heads * self.head_dim])], allowzero=1)
        (x,) = self.g.add("RotaryEmbedding", [x, "position_ids", "cos", "sin"], domain=ops.MS_DOMAIN,
                          interleaved=0, num_heads=heads)

        def reference(h):
            b, s = h.shape[:2]
            normed = ops.rms_norm(h.view(b, s, heads, self.head_dim), w, self.eps).view(b, s, -1)
            return ops.rotary(normed, feeds["position_ids"], feeds["cos"], feeds["sin"], heads)
        return x, ref.map(reference)

    def attention(self, i, x, ref, names, feeds):
        """The layer's qkv projection and cached tree attention: PackedTreeAttention (rotary inside)
        or, for q/k-normed models (Qwen3), Split + per-head norms + RotaryEmbedding + TreeAttention."""
        qkv, ref_qkv = self.linear(x, ref, [names["q"], names["k"], names["v"]], f"layers.{i}.qkv")
        past = [f"past_key_{i}", f"past_value_{i}", "past_len", "tree_mask"]
        outputs = [self.g.fresh("attention"), f"present_key_{i}", f"present_value_{i}"]
        caches = (feeds["caches"][2 * i], feeds["caches"][2 * i + 1], feeds["past_len"], feeds["tree_mask"])
        heads = dict(num_heads=self.heads, kv_num_heads=self.kv_heads)
        if self.config.model_type != "qwen3":  # no q/k norms
            self.g.add("PackedTreeAttention", [qkv, *past, "position_ids", "cos", "sin"], outputs,
                       domain=ops.DFLASH_DOMAIN, scale=self.scale, **heads)
            return outputs[0], ref_qkv.map(lambda h: ops.packed_attention(
                h, *caches, feeds["position_ids"], feeds["cos"], feeds["sin"], self.scale, **heads)[0])
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        q, k, v = self.g.add("Split", [qkv, self.g.constant(f"qkv_sizes_{i}", np.array(sizes, np.int64))], 3, axis=2)
        ref_q, ref_k, ref_v = ref_qkv.map(lambda h: tuple(h.split(sizes, dim=-1)))
        q, ref_q = self.head_norm_rotary(q, ref_q, self.heads, f"layers.{i}.q_norm", names["q_norm"], feeds)
        k, ref_k = self.head_norm_rotary(k, ref_k, self.kv_heads, f"layers.{i}.k_norm", names["k_norm"], feeds)
        self.g.add("TreeAttention", [q, k, v, *past], outputs, domain=ops.DFLASH_DOMAIN, scale=self.scale, **heads)
        return outputs[0], each(lambda a, b, c: ops.cached_attention(a, b, c, *caches, self.scale, **heads)[0],
                                ref_q, ref_k, ref_v)

    def build(self, feeds) -> tuple[Reference, Reference]:
        """Write every node and weight; the reference's (logits, taps) for `feeds`."""
        n, start = self.config.num_hidden_layers, time.perf_counter()
        hidden, ref_hidden = self.embedding(feeds["input_ids"])
        x, ref_x = self.rms_norm(hidden, ref_hidden, "layers.0.input_norm", self.weight_names(0)["input_norm"])
        taps, ref_taps = [], []
        for i in range(n):
            names = self.weight_names(i)
            attn, ref_attn = self.attention(i, x, ref_x, names, feeds)
            o, ref_o = self.linear(attn, ref_attn, [names["o"]], f"layers.{i}.o_proj")
            x, hidden, ref_x, ref_hidden = self.skip_norm(o, hidden, ref_o, ref_hidden, f"layers.{i}.post_norm",
                                                          names["post_norm"])
            gate_up, ref_gu = self.linear(x, ref_x, [names["gate"], names["up"]], f"layers.{i}.gate_up")
            (act,) = self.g.add("SwiGLU", [gate_up], domain=ops.DFLASH_DOMAIN)
            down, ref_down = self.linear(act, ref_gu.map(ops.swiglu), [names["down"]], f"layers.{i}.down")
            next_norm = ("norm", "model.norm.weight") if i == n - 1 else (
                f"layers.{i + 1}.input_norm", self.weight_names(i + 1)["input_norm"])
            tap_name = "taps" if self.taps == [i] else None  # one tap: the layer's output is the graph's
            x, hidden, ref_x, ref_hidden = self.skip_norm(down, hidden, ref_down, ref_hidden, *next_norm, tap_name)
            if i in self.taps:
                taps.append(hidden)
                ref_taps.append(ref_hidden)
            elapsed = time.perf_counter() - start
            self.progress(f"  layer {i + 1}/{n} written ({elapsed:.0f}s; about {elapsed / (i + 1) * (n - i - 1):.0f}s "
                          "more for the layers)")
        tied = getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in self.t
        logits, ref_logits = self.linear(x, ref_x, ["model.embed_tokens" if tied else "lm_head"], "lm_head",
                                         lm_head=True, output="logits")
        if len(taps) > 1:
            self.g.add("Concat", taps, ["taps"], axis=-1)
        return ref_logits, each(lambda *t: torch.cat(t, -1), *ref_taps)

    def rotary(self, feeds) -> None:
        cos, sin = rotary_tables_for(self.config, self.max_len)
        for name, table in (("cos", cos), ("sin", sin)):
            self.g.initializers.append(self.data.array(name, table.numpy()))
        check_cos, check_sin = rotary_tables_for(self.config, CHECK_CAPACITY)
        feeds.update(cos=check_cos, sin=check_sin)

    def save(self) -> None:
        n = self.config.num_hidden_layers
        f, i64 = TensorProto.FLOAT, TensorProto.INT64
        cache = [1, self.kv_heads, "capacity", self.head_dim]
        inputs = [helper.make_tensor_value_info("input_ids", i64, [1, "S"]),
                  helper.make_tensor_value_info("position_ids", i64, [1, "S"]),
                  helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["S", "S"]),
                  helper.make_tensor_value_info("past_len", i64, [])]
        outputs = [helper.make_tensor_value_info("logits", f, [1, "S", self.config.vocab_size]),
                   helper.make_tensor_value_info("taps", f, [1, "S", len(self.taps) * self.config.hidden_size])]
        for i in range(n):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", f, cache))
                outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", f, cache))
        graph = helper.make_graph(self.g.nodes, "target", inputs, outputs, self.g.initializers)
        opsets = [helper.make_opsetid("", 20), helper.make_opsetid(ops.MS_DOMAIN, 1),
                  helper.make_opsetid(ops.DFLASH_DOMAIN, 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="dflash-export (streaming)")
        model.ir_version = 10
        # the cache's capacity is symbolic, but the rotary tables hold max_len positions: the runtime
        # checks the manifest against this (runtime/target.py check_graph_matches)
        helper.set_model_props(model, {"max_len": str(self.max_len)})
        store_kv_as(model, self.kv_dtype, self.head_dim)
        self.data.close()
        onnx.save(model, str(self.path))


def release_large_blocks() -> None:
    """Have glibc's malloc map every block of 1 MB or more on its own and unmap it when freed.
    By default the threshold rises after each large free, and the weights' slices then fragment
    the heap: the process kept a few hundred MB it no longer used, growing with the model."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; a fixed value turns off its adjustment
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def rotary_tables_for(config, max_len: int):
    from .target import rotary_tables

    with torch.no_grad():
        return rotary_tables(rotary_module(config), max_len)


def check_feeds(config) -> dict:
    """The check's random inputs (export/target.py example_inputs) at a small cache capacity."""
    from .target import example_inputs

    ids, pos, mask, past_len, *caches = example_inputs(config, CHECK_CAPACITY, s=5, past=7, seed=1)
    return {"input_ids": ids, "position_ids": pos, "tree_mask": mask, "past_len": past_len, "caches": caches}


def export_streamed(folder_src: Path, config, taps, max_len: int, folder: Path, graph_name: str, plan, progress,
                    kv_dtype: str = "fp32") -> tuple[str, tuple[Reference, Reference]]:
    """Write folder/GRAPH_NAME.onnx (+ .data) from the safetensors of `folder_src`, its caches in
    format kv_dtype; the graph's file name and the reference's (logits, taps) for the check's
    inputs (`compare` takes them)."""
    release_large_blocks()
    tensors = FolderTensors(folder_src)
    writer = StreamExport(tensors, config, taps, max_len, folder, graph_name, plan, progress, kv_dtype)
    writer.check_weights()
    feeds = check_feeds(config)
    with torch.no_grad():
        writer.rotary(feeds)
        ref_logits, ref_taps = writer.build(feeds)
    writer.save()
    return writer.path.name, (ref_logits, ref_taps)


def compare(bundle: Path, config, refs, matmul: str | None) -> dict:
    """Run the bundle's target graph in ONNX Runtime on the check's inputs and bound its distance
    from the reference as export/check.py's check_target does."""
    from .check import bounds, run_checked

    feeds = check_feeds(config)
    inputs = [t.numpy() for t in (feeds["input_ids"], feeds["position_ids"], feeds["tree_mask"], feeds["past_len"])]
    # not made resident: the run reads only the check's embedding rows (an 8B model's table is 1.2 GB)
    got, kv = run_checked(bundle, inputs, [c.numpy() for c in feeds["caches"]], resident=False)
    if refs[0].quantized is None:  # the graph computes as fp32 does
        return kv(bounds(got, [r.fp32.numpy() for r in refs]))
    return kv(bounds(got, [r.quantized.numpy() for r in refs], [r.fp32.numpy() for r in refs], matmul))
