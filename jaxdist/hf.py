"""Hugging Face checkpoints in and out: `config.json` + safetensors ↔ jaxdist's Llama parameters.

The name and layout map, one row per tensor (HF stores `nn.Linear` weights as [out, in]; jaxdist as
[in, out] with the heads axis split out, and the layers stacked along a leading [L] axis):

| jaxdist (`params/...`) | shape        | Hugging Face (`LlamaForCausalLM`)              | shape      |
|------------------------|--------------|------------------------------------------------|------------|
| embed                  | [V, D]       | model.embed_tokens.weight                      | [V, D]     |
| layers/attn_norm[i]    | [D]          | model.layers.i.input_layernorm.weight          | [D]        |
| layers/wq[i]           | [D, N, H]    | model.layers.i.self_attn.q_proj.weight         | [N·H, D]   |
| layers/wk[i], wv[i]    | [D, K, H]    | model.layers.i.self_attn.{k,v}_proj.weight     | [K·H, D]   |
| layers/wo[i]           | [N, H, D]    | model.layers.i.self_attn.o_proj.weight         | [D, N·H]   |
| layers/mlp_norm[i]     | [D]          | model.layers.i.post_attention_layernorm.weight | [D]        |
| layers/w_gate[i], w_up | [D, F]       | model.layers.i.mlp.{gate,up}_proj.weight       | [F, D]     |
| layers/w_down[i]       | [F, D]       | model.layers.i.mlp.down_proj.weight            | [D, F]     |
| final_norm             | [D]          | model.norm.weight                              | [D]        |
| head (untied only)     | [D, V]       | lm_head.weight                                 | [V, D]     |

Both sides use the rotate-half rotary layout (transformers' `rotate_half`), so no row permutation
is needed (Meta's original checkpoints interleave the pairs; transformers' converter permutes them
once, and HF checkpoints are already in this layout). Files are read and written with the
`safetensors` numpy API, one tensor at a time; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import ml_collections
import numpy as np

from jaxdist.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size
INDEX_FILE = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that are recomputed, not learned: skipped on import.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Files copied along with the weights, so a run folder keeps the model's tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# ------------------------------------------------------------------------------------------------
# config.json ↔ config.model


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """`HF_DIR/config.json` as a dict; ConfigError when missing, unreadable or malformed."""
    path = os.path.join(hf_dir, "config.json")
    _need(os.path.isdir(hf_dir), f"{hf_dir}: no such directory")
    _need(os.path.isfile(path), f"{path}: no such file (a Hugging Face model folder has one)")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    _need(isinstance(cfg, dict), f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def is_hf_folder(path: str) -> bool:
    """A folder with a Hugging Face `config.json` (one naming `architectures` or `model_type`)."""
    try:
        cfg = read_hf_config(path)
    except ConfigError:
        return False
    return "architectures" in cfg or "model_type" in cfg


def _field(hf: dict, key: str, where: str, kind: type, default: Any = None) -> Any:
    """hf[key] (or `default`), checked to be an int, or a number when `kind` is float."""
    value = hf.get(key, default)
    _need(value is not None, f"{where}: missing field {key!r}")
    ok = not isinstance(value, bool) and isinstance(value, int | float if kind is float else int)
    _need(ok, f"{where}: {key}={value!r} must be {'a number' if kind is float else 'an integer'}")
    return kind(value)


def model_config_from_hf(hf: dict, where: str = "config.json") -> ml_collections.ConfigDict:
    """The `config.model` of a Hugging Face `LlamaForCausalLM` config.json.

    Raises:
      ConfigError: another architecture, a Llama variant jaxdist does not implement (biases, an
        activation other than SiLU, a RoPE type other than default/llama3), or a missing or
        mistyped field; one line naming `where` and the field.
    """
    from jaxdist.config import base_config

    arch = hf.get("architectures") or []
    _need(
        isinstance(arch, list) and any(a in ARCHITECTURES for a in arch),
        f"{where}: architectures={arch!r} is not supported; jaxdist imports "
        + ", ".join(ARCHITECTURES),
    )
    for key in ("attention_bias", "mlp_bias"):
        _need(not hf.get(key, False), f"{where}: {key}=true is not supported (bias-free only)")
    act = hf.get("hidden_act", "silu")
    _need(act == "silu", f"{where}: hidden_act={act!r} is not supported; Llama uses 'silu'")
    m = base_config().model
    m.name = "llama"
    m.vocab_size = _field(hf, "vocab_size", where, int)
    m.d_model = _field(hf, "hidden_size", where, int)
    m.mlp_dim = _field(hf, "intermediate_size", where, int)
    m.num_layers = _field(hf, "num_hidden_layers", where, int)
    m.num_heads = _field(hf, "num_attention_heads", where, int)
    m.num_kv_heads = _field(hf, "num_key_value_heads", where, int, m.num_heads)
    m.head_dim = _field(hf, "head_dim", where, int, m.d_model // max(m.num_heads, 1))
    m.seq_len = _field(hf, "max_position_embeddings", where, int)
    m.norm_eps = _field(hf, "rms_norm_eps", where, float, 1e-6)
    m.tie_embeddings = bool(hf.get("tie_word_embeddings", False))
    # transformers 5 writes `rope_parameters` (rope_theta inside); earlier, top-level `rope_theta`
    # and `rope_scaling`.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    _need(isinstance(rope, dict), f"{where}: rope_parameters/rope_scaling must be an object")
    m.rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    _need(
        kind in ("default", "llama3"),
        f"{where}: rope type {kind!r} is not supported; jaxdist implements default, llama3",
    )
    if kind == "llama3":
        rs = m.rope_scaling
        rs.type = "llama3"
        for ours, theirs in (
            ("factor", "factor"),
            ("low_freq_factor", "low_freq_factor"),
            ("high_freq_factor", "high_freq_factor"),
        ):
            rs[ours] = _field(rope, theirs, f"{where} rope_scaling", float)
        rs.original_max_len = _field(
            rope, "original_max_position_embeddings", f"{where} rope_scaling", int
        )
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    m.eos_token_id = eos if isinstance(eos, int) else -1
    from models import llama

    d = llama.dims(m)
    _need(
        d["N"] % d["K"] == 0,
        f"{where}: num_attention_heads={d['N']} is not a multiple of num_key_value_heads={d['K']}",
    )
    return m


def hf_config_from(m, dtype: str = "float32") -> dict[str, Any]:
    """A `LlamaForCausalLM` config.json for `config.model` `m` (transformers 4.x and 5 read it)."""
    from models import llama

    d = llama.dims(m)
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": d["V"],
        "hidden_size": d["D"],
        "intermediate_size": d["F"],
        "num_hidden_layers": d["L"],
        "num_attention_heads": d["N"],
        "num_key_value_heads": d["K"],
        "head_dim": d["H"],
        "max_position_embeddings": int(m.seq_len),
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": float(m.rope_theta),
        "rope_scaling": None,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if m.rope_scaling.type == "llama3":
        rs = m.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_len),
        }
    if m.eos_token_id >= 0:
        out["eos_token_id"] = int(m.eos_token_id)
    return out


# ------------------------------------------------------------------------------------------------
# The tensor map.


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One jaxdist parameter and its Hugging Face tensor(s).

    Attributes:
      path: top-level key, or ("layers", name) for a stacked layer parameter.
      hf_name: the HF tensor name; "{i}" is the layer index for stacked ones.
      hf_shape: the HF tensor's shape (one layer's).
      to_jax: HF array -> jaxdist array (one layer's).
      to_hf: jaxdist array (one layer's) -> HF array.
    """

    path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    to_jax: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"


def tensor_map(m) -> list[Tensor]:
    """Every parameter of the Llama for `config.model` `m`, in jaxdist's tree order."""
    from models import llama

    d = llama.dims(m)
    D, N, K, H, F, V = d["D"], d["N"], d["K"], d["H"], d["F"], d["V"]
    same = lambda a: a
    linear = lambda shape: (lambda w: w.T.reshape(shape), lambda w: w.reshape(w.shape[0], -1).T)
    out_proj = (lambda w: w.T.reshape(N, H, D), lambda w: w.reshape(N * H, D).T)
    layer = "model.layers.{i}."
    rows = [
        (("embed",), "model.embed_tokens.weight", (V, D), (same, same)),
        (("layers", "attn_norm"), layer + "input_layernorm.weight", (D,), (same, same)),
        (("layers", "wq"), layer + "self_attn.q_proj.weight", (N * H, D), linear((D, N, H))),
        (("layers", "wk"), layer + "self_attn.k_proj.weight", (K * H, D), linear((D, K, H))),
        (("layers", "wv"), layer + "self_attn.v_proj.weight", (K * H, D), linear((D, K, H))),
        (("layers", "wo"), layer + "self_attn.o_proj.weight", (D, N * H), out_proj),
        (("layers", "mlp_norm"), layer + "post_attention_layernorm.weight", (D,), (same, same)),
        (("layers", "w_gate"), layer + "mlp.gate_proj.weight", (F, D), linear((D, F))),
        (("layers", "w_up"), layer + "mlp.up_proj.weight", (F, D), linear((D, F))),
        (("layers", "w_down"), layer + "mlp.down_proj.weight", (D, F), linear((F, D))),
        (("final_norm",), "model.norm.weight", (D,), (same, same)),
    ]
    if not m.tie_embeddings:
        rows.append((("head",), "lm_head.weight", (V, D), linear((D, V))))
    return [Tensor(p, n, s, *fns) for p, n, s, fns in rows]


def hf_names(m) -> list[str]:
    """Every HF tensor name the model has, layers expanded."""
    names = []
    for t in tensor_map(m):
        layers = range(m.num_layers) if t.stacked else [None]
        names += [t.hf_name.format(i=i) for i in layers]
    return names


# ------------------------------------------------------------------------------------------------
# Reading safetensors.


class Weights:
    """The tensors of an HF folder: `model.safetensors`, or the shards its index names, or (with
    neither) every `*.safetensors` file in it. Tensors are read one at a time (memory-mapped)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._open = safe_open
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                _need(isinstance(weight_map, dict), "weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
                raise ConfigError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                _need(
                    os.path.isfile(os.path.join(hf_dir, name)),
                    f"{index} names {name}, which is missing from {hf_dir}",
                )
            self.file_of = {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
        else:
            files = (
                [single] if os.path.isfile(single) else sorted(glob.glob(f"{hf_dir}/*.safetensors"))
            )
            _need(
                bool(files),
                f"{hf_dir}: no model.safetensors, {INDEX_FILE} or *.safetensors file "
                "(PyTorch .bin checkpoints are not read: they are pickles)",
            )
            self.file_of = {}
            for path in files:
                for name in self._keys(path):
                    self.file_of[name] = path
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _keys(self, path: str) -> list[str]:
        try:
            with self._open(path, framework="numpy") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error type for a corrupt header
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.file_of)

    def get(self, name: str) -> np.ndarray:
        path = self.file_of[name]
        try:
            with self._open(path, framework="numpy") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise ConfigError(f"{path}: tensor {name} unreadable ({e})") from None


def check_names(weights: Weights, m, where: str) -> None:
    """ConfigError for a missing tensor or one no Llama parameter takes."""
    want = set(hf_names(m))
    have = {n for n in weights.names() if not n.endswith(_IGNORED_SUFFIXES)}
    if m.tie_embeddings:
        have.discard("lm_head.weight")  # some tied checkpoints store the table twice
    missing = sorted(want - have, key=_natural)
    _need(
        not missing,
        f"{where}: missing tensor {missing[0] if missing else ''} ({len(missing)} missing; "
        f"config.json implies {len(want)} tensors)",
    )
    extra = sorted(have - want, key=_natural)
    _need(
        not extra,
        f"{where}: unexpected tensor {extra[0] if extra else ''} ({len(extra)} such) for a "
        "LlamaForCausalLM with this config.json",
    )


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def read_params(
    weights: Weights, m, where: str, dtype=np.float32
) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(path, jaxdist array) for every parameter, one at a time; stacked ones gather their L
    layers. Shapes are checked against config.json before each is converted."""
    check_names(weights, m, where)
    for t in tensor_map(m):
        layers = range(m.num_layers) if t.stacked else [None]
        out = None
        for j, i in enumerate(layers):
            name = t.hf_name.format(i=i)
            a = weights.get(name)
            _need(
                tuple(a.shape) == t.hf_shape,
                f"{weights.file_of[name]}: {name} has shape {list(a.shape)}, but config.json "
                f"implies {list(t.hf_shape)}",
            )
            value = t.to_jax(a.astype(dtype))
            if not t.stacked:
                out = np.ascontiguousarray(value)
                break
            if out is None:
                out = np.empty((m.num_layers, *value.shape), dtype)
            out[j] = value
        yield t.path, out


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# ------------------------------------------------------------------------------------------------
# Writing safetensors.


def write_hf(
    params: dict, m, out_dir: str, *, dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES
) -> dict[str, Any]:
    """Writes `config.json` and the weights (`model.safetensors`, or shards and their index past
    `max_shard_bytes`) of jaxdist Llama `params` (host arrays) into the existing `out_dir`.

    Returns: {"files": [...], "tensors": n, "bytes": total}.
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for t in tensor_map(m):
        try:
            value = np.asarray(get_path(params, t.path))
        except (KeyError, TypeError):
            raise ConfigError(f"the checkpoint has no params/{'/'.join(t.path)}") from None
        layers = range(m.num_layers) if t.stacked else [None]
        _need(
            not t.stacked or value.shape[0] == m.num_layers,
            f"params/{'/'.join(t.path)} has {value.shape[0]} layers, model.num_layers="
            f"{m.num_layers}",
        )
        for i in layers:
            a = np.ascontiguousarray(t.to_hf(value[i] if t.stacked else value).astype(np_dtype))
            _need(
                a.shape == t.hf_shape,
                f"params/{'/'.join(t.path)} is {list(value.shape)}, which does not fit the "
                f"config's {t.hf_name.format(i=i)} {list(t.hf_shape)}",
            )
            if size and size + a.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][t.hf_name.format(i=i)] = a
            size += a.nbytes
            total += a.nbytes
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_from(m, dtype), f, indent=2)
    return {"files": names, "tensors": len(weight_map), "bytes": total}


def param_count(m) -> int:
    return sum(math.prod(t.hf_shape) * (m.num_layers if t.stacked else 1) for t in tensor_map(m))
