"""The reference model: a small Llama-shaped LM trained here, on the Python standard library.

Judging a lossy KV codec needs a model that has learned something (random weights attend to
nothing in particular), and no trained LM can be downloaded on these machines. So KDN trains one:

- corpus: the ``.py`` files of the running interpreter's standard library (``sysconfig``'s
  ``stdlib`` path, without ``site-packages`` and the ``test``/``tests`` trees), split into train
  and held-out sets *by file*: a file is held out when a digest of its relative path says so, so
  the split is the same on every machine and never depends on listing order;
- tokenizer: byte-level BPE trained with ``tokenizers`` on the train files only;
- model: ``LlamaForCausalLM`` with grouped-query attention, a few million parameters;
- output: a standard Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer
  files loadable by ``AutoTokenizer``) plus ``kdn_reference.json`` (how it was made, the losses),
  written to a temporary sibling and renamed into place, so a killed run never leaves half a model.

Seeded: the same :class:`TrainConfig`, interpreter and thread count give the same weights.
Default location: ``$KDN_CACHE/reference-model``, ``KDN_CACHE`` defaulting to ``~/.cache/kdn``.

Command: ``kdn model train-reference [--out DIR] [--steps N] [--preset default|tiny] [--json]``
(the rest of ``kdn model`` lives in :mod:`kdn.ops.model`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdn.console import report_error
from kdn.errors import InvalidInput, KdnError
from kdn.lab.layout import EOS_TOKEN, META_FILE, PAD_TOKEN, cache_root, publish, save_model  # noqa: F401  (part of this module's API)
from kdn.lab.training import fit, new_llama

REFERENCE_DIRNAME = "reference-model"


def default_reference_dir(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / REFERENCE_DIRNAME


# -- corpus -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CorpusSplit:
    """Standard-library source files, split by file. Paths are sorted; the split is by digest."""

    root: Path
    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_heldout(rel: str, heldout_per_mille: int) -> bool:
    digest = hashlib.blake2b(rel.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1000 < heldout_per_mille


def corpus_split(
    root: Path | None = None, *, heldout_per_mille: int = 50, max_files: int | None = None
) -> CorpusSplit:
    """The stdlib ``.py`` files under ``root`` split into train/held-out by a digest of the path.

    ``max_files`` keeps the first files of each split (in sorted order), for fast test variants.
    """
    root = stdlib_root() if root is None else Path(root)
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune: never descend into site-packages
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files.sort()
    if not files:
        raise InvalidInput(f"no Python source files under {root}")
    train, held = [], []
    for p in files:
        (held if _is_heldout(p.relative_to(root).as_posix(), heldout_per_mille) else train).append(p)
    if max_files is not None:
        train, held = train[:max_files], held[: max(1, max_files // 4)]
    if not train or not held:
        raise InvalidInput(f"corpus under {root} is too small to split ({len(train)} train, {len(held)} held out)")
    return CorpusSplit(root, tuple(train), tuple(held))


def read_texts(files: Sequence[Path], *, max_chars_per_file: int | None = None) -> list[str]:
    out = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        out.append(text[:max_chars_per_file] if max_chars_per_file else text)
    return out


def heldout_texts(*, max_files: int | None = None) -> list[str]:
    """The held-out split's texts (what the quality harness reads by default)."""
    return read_texts(corpus_split(max_files=max_files).heldout)


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything that decides the trained weights (also written to ``kdn_reference.json``)."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: 2 query heads share each KV head
    head_dim: int = 64
    max_positions: int = 1024
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 450
    lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    eval_windows: int = 24
    max_files: int | None = None  # None: the whole stdlib
    max_chars_per_file: int | None = None
    threads: int = 2

    @classmethod
    def preset(cls, name: str) -> "TrainConfig":
        if name == "default":
            return cls()
        if name == "tiny":  # the same code path in seconds: tests
            return cls(
                vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                num_kv_heads=1, head_dim=16, max_positions=256, seq_len=64, batch_size=4, steps=30,
                lr=1e-2, warmup_steps=3, eval_windows=4, max_files=24, max_chars_per_file=6000, threads=1,
            )
        raise InvalidInput(f"unknown preset {name!r}; choose default or tiny")

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidInput("num_heads must be a multiple of num_kv_heads")
        if min(self.steps, self.seq_len, self.batch_size, self.vocab_size) <= 0:
            raise InvalidInput("steps, seq_len, batch_size and vocab_size must be positive")
        if self.seq_len > self.max_positions:
            raise InvalidInput("seq_len must not exceed max_positions")


@dataclass(frozen=True, slots=True)
class TrainResult:
    out_dir: Path
    params: int
    train_tokens: int
    heldout_tokens: int
    initial_heldout_loss: float
    heldout_loss: float
    uniform_loss: float
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["heldout_perplexity"] = math.exp(self.heldout_loss)
        return d


# -- tokenizer ----------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _hf_tokenizer(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        unk_token=None, model_max_length=1 << 30,
    )


def token_stream(tok: Any, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one ``(N,)`` int64 stream, documents separated by the EOS token."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# -- model and training -------------------------------------------------------------------------


def _windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows of ``length`` tokens: ``(n, length)``."""
    if stream.numel() <= length:
        raise InvalidInput(f"token stream of {stream.numel()} tokens is shorter than a window of {length}")
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def _eval_loss(model: Any, windows: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]  # (B, S+1)
        logits = model(input_ids=w[:, :-1]).logits  # (B, S, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train()
    return total / count


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_reference(
    cfg: TrainConfig,
    out_dir: Path,
    *,
    corpus_root: Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> TrainResult:
    """Train the reference model and save it as a Hugging Face directory at ``out_dir``."""
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        split = corpus_split(corpus_root, max_files=cfg.max_files)
        train_texts = read_texts(split.train, max_chars_per_file=cfg.max_chars_per_file)
        held_texts = read_texts(split.heldout, max_chars_per_file=cfg.max_chars_per_file)
        log(f"corpus: {len(split.train)} train files, {len(split.heldout)} held-out files under {split.root}")
        tok = train_tokenizer(train_texts, cfg.vocab_size)
        train_ids = token_stream(tok, train_texts)  # (N,)
        held_ids = token_stream(tok, held_texts)  # (M,)
        log(f"tokenizer: {tok.get_vocab_size()} tokens; {train_ids.numel():,} train / {held_ids.numel():,} held-out tokens")

        torch.manual_seed(cfg.seed)
        model = new_llama(cfg, cfg.vocab_size, tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN))
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        data_gen = torch.Generator().manual_seed(cfg.seed + 1)
        eval_gen = torch.Generator().manual_seed(cfg.seed + 2)
        held_windows = _windows(held_ids, cfg.eval_windows, min(cfg.seq_len, held_ids.numel() - 1) + 1, eval_gen)
        initial = _eval_loss(model, held_windows, cfg.batch_size)

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            b = _windows(train_ids, cfg.batch_size, cfg.seq_len + 1, data_gen)  # (B, S+1)
            return b[:, :-1], b[:, 1:]

        fit(model, steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay, lr_at=lambda s: _lr_at(s, cfg),
            batch=batch, desc="train-reference", progress=progress)
        final = _eval_loss(model, held_windows, cfg.batch_size)
        seconds = time.perf_counter() - t0
        result = TrainResult(
            out_dir=Path(out_dir), params=n_params, train_tokens=int(train_ids.numel()),
            heldout_tokens=int(held_ids.numel()), initial_heldout_loss=initial, heldout_loss=final,
            uniform_loss=math.log(cfg.vocab_size), seconds=seconds,
        )
        _save(model, tok, cfg, result, split, Path(out_dir))
        return result
    finally:
        torch.set_num_threads(prev_threads)


def _save(model: Any, tok: Any, cfg: TrainConfig, result: TrainResult, split: CorpusSplit, out: Path) -> None:
    """Write the directory next to ``out`` and rename it into place (no half-written model)."""
    meta = {
        "kind": "kdn-reference-model",
        "train_config": asdict(cfg),
        "result": {k: v for k, v in result.as_dict().items() if k != "out_dir"},
        "corpus": {
            "root": str(split.root),
            "train_files": len(split.train),
            "heldout_files": [p.relative_to(split.root).as_posix() for p in split.heldout],
        },
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    save_model(out, model, _hf_tokenizer(tok), meta)


# -- CLI ----------------------------------------------------------------------------------------


def _already_trained(out: Path, args: argparse.Namespace) -> bool:
    """``out`` holds a model and ``--force`` was not given: say so (and how to retrain)."""
    if not (out / "config.json").is_file() or args.force:
        return False
    print(f"{out} already holds a model (use --force to retrain)", file=sys.stderr)
    if args.json:
        print(json.dumps({"out_dir": str(out), "skipped": True}))
    return True


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The preset fields the command line sets (``--steps``, ``--seed``, ``--threads``)."""
    return {k: v for k, v in (("steps", args.steps), ("seed", args.seed), ("threads", args.threads)) if v is not None}


def _train_retrieval(args: argparse.Namespace) -> int:
    from kdn.lab.retrieval import RetrievalTrainConfig, default_retrieval_dir, train_retrieval

    out = args.out or default_retrieval_dir()
    if _already_trained(out, args):
        return 0
    result = train_retrieval(replace(RetrievalTrainConfig.preset(args.preset), **_overrides(args)), out, progress=True)
    d = result.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"saved {result.out_dir}: {result.params / 1e6:.2f}M params, held-out accuracy with full prefill "
              f"{result.heldout_accuracy:.3f} on {result.heldout_prompts} prompts of {result.eval_docs} documents, "
              f"in {result.seconds:.0f}s")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kdn model", description="model tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train-reference", help="train the small reference LM on the Python stdlib")
    tr.add_argument("--out", type=Path, default=None, help=f"output dir (default $KDN_CACHE/{REFERENCE_DIRNAME})")
    tr.add_argument("--task", default="stdlib", choices=["stdlib", "retrieval"],
                    help="stdlib: language model on the Python stdlib (codec quality); retrieval: the multi-document "
                         "retrieval task (blend quality, kdn.lab.retrieval)")
    tr.add_argument("--preset", default="default", choices=["default", "tiny"],
                    help="model and training size: default (the reference model), tiny (a quick one for tests)")
    tr.add_argument("--steps", type=int, default=None, help="optimiser steps (overrides the preset)")
    tr.add_argument("--seed", type=int, default=None, help="random seed (default: the preset's)")
    tr.add_argument("--threads", type=int, default=None, help="torch threads (part of what makes a run reproducible)")
    tr.add_argument("--force", action="store_true", help="retrain even if the output dir holds a model")
    tr.add_argument("--json", action="store_true", help="print one JSON object (errors too)")
    args = parser.parse_args(argv)
    try:
        if args.task == "retrieval":
            return _train_retrieval(args)
        out = args.out or default_reference_dir()
        if _already_trained(out, args):
            return 0
        cfg = replace(TrainConfig.preset(args.preset), **_overrides(args))
        result = train_reference(cfg, out, progress=True)  # the bar goes to stderr
    except KdnError as exc:
        report_error(f"model {args.cmd}", exc, as_json=args.json)
        return 2
    d = result.as_dict()
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(
            f"saved {result.out_dir}: {result.params / 1e6:.2f}M params, held-out loss "
            f"{result.initial_heldout_loss:.3f} -> {result.heldout_loss:.3f} nats/token "
            f"(uniform {result.uniform_loss:.3f}; perplexity {d['heldout_perplexity']:.1f}) in {result.seconds:.0f}s"
        )
    return 0
