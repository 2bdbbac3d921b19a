"""lm-eval-harness's model interface (`lm_eval.api.model.LM`) over jaxdist's own forward and generation.

    lm = JaxdistLM("runs/llama_own")                      # a run, checkpoints or HF folder
    tasks = load_tasks(["jaxdist_choice"], ["configs/lm_eval_tasks"])
    results = evaluate(lm, tasks)                         # lm-eval's results dict

Scoring (`loglikelihood`, `loglikelihood_rolling`) runs the model's sharded forward (the module the
training step runs, on a data × tensor mesh) on batches of right-padded rows; generation
(`generate_until`) runs `jaxdist.generate`, the key/value-cache decoder `scripts/sample.py` uses.
Everything around the model follows lm-eval's own Hugging Face backend (`HFLM`) step for step, so
the two give the same numbers on the same weights (tests/test_lm_eval.py): the pairs are encoded by
lm-eval's `TemplateLM` (trailing spaces of the context move to the continuation, the whole string is
encoded and split); a row longer than the context keeps its last `max_length` tokens; rolling
log-likelihoods use lm-eval's disjoint windows behind the prefix token (BOS, else EOS); a generation
context keeps its last `max_length - max_gen_toks` tokens, decodes until EOS or `max_gen_toks`, and
is cut at the first stop string. `max_length` is `model.seq_len` (an HF folder's
`max_position_embeddings`).

This module needs the `eval` extra (lm-eval); nothing else in jaxdist imports it, so the default
install does not. Task data is read from local files only: the hub is switched off
(`HF_DATASETS_OFFLINE`, `HF_HUB_OFFLINE`) before lm-eval loads.
"""

from __future__ import annotations

import difflib
import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # no network at run time: local task files
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.utils import (  # noqa: E402
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

import models  # noqa: E402
from jaxdist import data, generate, sharding, token_shards, weights  # noqa: E402
from jaxdist import tokenizer as tokenizer_lib  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402

SHIPPED_TASKS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "lm_eval_tasks"
)
MIN_LENGTH = 16  # the shortest padded row length (rows pad to powers of two: few compiles)


def _special_token(tok, config: dict, key: str) -> int | None:
    """The id of `tokenizer_config.json`'s `key` (e.g. "eos_token": "</s>" or {"content": ...})."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_id(value) if isinstance(value, str) else None


class JaxdistLM(TemplateLM):
    """A jaxdist model as lm-eval sees it: `loglikelihood`, `loglikelihood_rolling`,
    `generate_until`.

    Args:
      checkpoint: a jaxdist run folder, its checkpoints folder or a Hugging Face folder.
      step: the checkpoint step (default: the latest).
      data: devices the rows are split over (simulated on a CPU by the caller).
      tensor: devices the attention heads are split over.
      batch_size: rows per forward / per generation call (rounded up to a multiple of `data`).

    Raises:
      ConfigError: the folder is no model, its family cannot generate, or it has no tokenizer.
    """

    def __init__(
        self,
        checkpoint: str,
        *,
        step: int | None = None,
        data: int = 1,
        tensor: int = 1,
        batch_size: int = 8,
    ):
        super().__init__()
        src = weights.resolve(checkpoint, step)
        m = src.config.model
        self.family = models.get(m.name)
        if self.family.decoder is None:
            able = [n for n in models.names() if models.get(n).decoder is not None]
            raise ConfigError(
                f"model.name={m.name!r} in {checkpoint} is no language model lm-eval can score; "
                f"families that can: {', '.join(able)}"
            )
        self.src, self.cfg = src, m
        self.tok, self.tokenizer_source = self._tokenizer(src)
        self.eos_id, self.bos_id = self._special_ids(src, self.tok)
        if data * tensor > jax.device_count():
            raise ConfigError(
                f"data × tensor = {data * tensor} devices, but {jax.device_count()} are present"
            )
        self.data = data
        self.batch = -(-max(1, batch_size) // data) * data
        _, self.model, self.mesh, params = weights.load_onto_mesh(
            src, None, data=data, tensor=tensor
        )
        self.dtype = jnp.dtype(src.config.train.compute_dtype)
        self.params = jax.tree.map(lambda p: p.astype(self.dtype), params)
        spec = sharding.logical_to_spec(("batch", "length"), sharding.COMPUTE_RULES, self.mesh)
        self._rows = jax.sharding.NamedSharding(self.mesh, spec)
        self._score = jax.jit(self._score_fn)

    # -- what lm-eval asks of a model --------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        if self.eos_id is None:
            raise ConfigError(
                f"{self.src.path}'s tokenizer ({self.tokenizer_source}) has no EOS token, which "
                "this task needs (an empty context, rolling log-likelihoods or a stop token)"
            )
        return self.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is replaced by: BOS, else EOS (as `HFLM`)."""
        return self.bos_id if self.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return int(self.cfg.seq_len)

    @property
    def max_gen_toks(self) -> int:
        return 256

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """`string`'s ids; by default with the tokenizer's own special tokens (its post-processor),
        unless the string already starts with the BOS token (as `HFLM.tok_encode`)."""
        if add_special_tokens is None:
            bos = self.tok.decode([self.bos_id], False) if self.bos_id is not None else None
            add_special_tokens = not has_bos_prefix(string, bos)
        return self.tok.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per
        (key, context ids, continuation ids), scored in batches of right-padded rows."""
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ConfigError(
                    f"a request has {len(context)} context and {len(continuation)} continuation "
                    f"tokens; lm-eval needs at least one of each and a continuation of at most "
                    f"max_length={self.max_length}"
                )
            whole = (context + continuation)[-(self.max_length + 1) :]
            rows.append((whole, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            longest = max(len(rows[i][0]) - 1 for i in chunk)
            T = min(max(MIN_LENGTH, 1 << (longest - 1).bit_length()), self.max_length)
            inputs = np.zeros((self.batch, T), np.int32)
            targets = np.zeros((self.batch, T), np.int32)
            for r, i in enumerate(chunk):
                whole = rows[i][0]
                inputs[r, : len(whole) - 1] = whole[:-1]
                targets[r, : len(whole) - 1] = whole[1:]
            logp, greedy = jax.device_get(
                self._score(
                    self.params,
                    jax.device_put(inputs, self._rows),
                    jax.device_put(targets, self._rows),
                )
            )
            for r, i in enumerate(chunk):
                whole, n = rows[i]
                span = slice(len(whole) - 1 - n, len(whole) - 1)
                out[i] = (
                    float(np.sum(logp[r, span], dtype=np.float64)),
                    bool(greedy[r, span].all()),
                )
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole string: lm-eval's disjoint windows of `max_length` tokens,
        the first behind the prefix token, summed."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations decoded with the key/value cache (`jaxdist.generate`): greedy unless the
        task asks to sample, until EOS or `max_gen_toks`, cut at the first stop string."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        eos = self.tok_decode([self.eos_id], False) if self.eos_id is not None else None
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if max_gen >= self.max_length:
                raise ConfigError(
                    f"max_gen_toks={max_gen} leaves no room for a context in "
                    f"max_length={self.max_length}"
                )
            sampling = generate.Sampling(
                float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                int(kwargs.get("top_k", 0) or 0),
                float(kwargs.get("top_p", 1.0) or 1.0),
            )
            keep = self.max_length - max_gen
            prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in members]
            for start in range(0, len(members), self.batch):
                chunk = prompts[start : start + self.batch]
                padded = chunk + [chunk[0]] * (-len(chunk) % self.data)
                result = generate.generate(
                    self.family.decoder(self.cfg),
                    self.params,
                    padded,
                    max_gen,
                    sampling=sampling,
                    eos_id=self.eos_id,
                    mesh=self.mesh,
                    cache_dtype=self.dtype,
                )
                for i, new in zip(members[start : start + self.batch], result.tokens):
                    text = postprocess_generated_text(self.tok_decode(new), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # -- inside ------------------------------------------------------------------------------------

    def _score_fn(self, params, inputs, targets):
        """Each target's log-probability [B, T] and whether it is the argmax [B, T], float32; the
        target's entry is picked with a one-hot product (no gather over a sharded vocabulary)."""
        with sharding.activation_rules(self.mesh):
            logits = self.model.merge(params)(inputs).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
            picked = jnp.sum(one_hot * logp, axis=-1)
            return picked, jnp.argmax(logits, axis=-1) == targets

    @staticmethod
    def _tokenizer(src):
        """The folder's tokenizer.json, or UTF-8 bytes for a run that trained on bytes."""
        path = src.file("tokenizer.json")
        if path is not None:
            return tokenizer_lib.load(path), path
        source = src.config.data.source
        if src.kind == "jaxdist" and source != "digits" and not data.is_token_source(source):
            return tokenizer_lib.Bytes(), "UTF-8 bytes"
        raise ConfigError(
            f"{src.path} has no tokenizer (no tokenizer.json, and it did not train on bytes); "
            "lm-eval tasks are text, so the model needs one"
        )

    def _special_ids(self, src, tok) -> tuple[int | None, int | None]:
        """(EOS, BOS) ids: `tokenizer_config.json`'s, as transformers reads them; else EOS from the
        model's `eos_token_id` or a conventional EOS token in the vocabulary."""
        config: dict[str, Any] = {}
        path = src.file("tokenizer_config.json")
        if path is not None:
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
        eos = _special_token(tok, config, "eos_token")
        bos = _special_token(tok, config, "bos_token")
        if eos is None and self.cfg.eos_token_id >= 0:
            eos = int(self.cfg.eos_token_id)
        if eos is None:
            eos = next(
                (i for t in token_shards.EOS_CANDIDATES if (i := tok.token_id(t)) is not None),
                None,
            )
        return eos, bos


def load_tasks(names: list[str], include: list[str], *, builtin: bool = False) -> dict:
    """lm-eval's task dict for `names` (tasks, groups or tags), their data loaded from local
    files. Searched: the `include` folders of task YAML (the shipped ones: configs/lm_eval_tasks),
    and lm-eval's own tasks with `builtin` or when no folder is given (indexing those takes a
    minute, and their datasets must already be in the local cache: nothing is downloaded).

    Raises:
      ConfigError: an unknown name (with the nearest known ones), a folder or data file missing.
    """
    if not names or not all(names):
        raise ConfigError("--lm_eval_tasks: give task names, e.g. --lm_eval_tasks=jaxdist_choice")
    for path in include:
        if not os.path.isdir(path):
            raise ConfigError(
                f"--lm_eval_include={path}: no such folder (a folder of lm-eval task YAML files, "
                f"e.g. {os.path.relpath(SHIPPED_TASKS)})"
            )
    from lm_eval.tasks import TaskManager

    dirs = list(dict.fromkeys(os.path.abspath(p) for p in include))
    builtin = builtin or not dirs
    manager = TaskManager(include_path=dirs or None, include_defaults=builtin)
    known = set(manager.all_tasks) | set(manager.all_groups) | set(manager.all_tags)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3) or sorted(known)[:5]
            where = [*dirs, *(["lm-eval's own tasks"] if builtin else [])]
            hint = "" if builtin else "; lm-eval's own tasks: add --lm_eval_builtin"
            if not include:
                hint = f"; the shipped tasks: --lm_eval_include={os.path.relpath(SHIPPED_TASKS)}"
            raise ConfigError(
                f"--lm_eval_tasks: no task {name!r} in {', '.join(where)}; known: "
                f"{', '.join(near)}{hint}"
            )
    try:
        return manager.load(list(names))
    except FileNotFoundError as e:
        raise ConfigError(
            f"--lm_eval_tasks={','.join(names)}: a data file is missing ({e}); task files read "
            "relative paths from the current directory (run from the repository root)"
        ) from None
    except (ConnectionError, OSError) as e:
        raise ConfigError(
            f"--lm_eval_tasks={','.join(names)}: its data is not on this machine ({e}); lm-eval "
            "hub datasets need a download, local task files (--lm_eval_include) do not"
        ) from None


def evaluate(lm: TemplateLM, tasks: dict, *, limit: int | None = None) -> dict:
    """lm-eval's `evaluate` of `lm` on `tasks` (from `load_tasks`): its results dict, with
    `results` (metrics per task) and `samples` (each item's requests and responses)."""
    from lm_eval.evaluator import evaluate as lm_evaluate

    return lm_evaluate(lm, tasks, limit=limit, bootstrap_iters=0, log_samples=True)
