"""A reference model that reads: a synthetic multi-document retrieval task and its trainer.

Judging non-prefix reuse (blending) needs a model whose answer depends on attending to the right
document among distractors; a random-init model attends to nothing in particular, and no trained
LM can be downloaded here. So KDN trains one, in minutes, on this task:

- **documents**: ``doc_tokens`` words each, written ``D : <filler and facts>``; a fact is
  ``KEY VAL .`` with ``value_words`` value words (``KEY`` one of ``num_keys`` words ``k0 ..``,
  ``VAL`` of ``num_values`` words ``v0 ..``); the rest is filler words ``f0 ..``. Keys are unique within a prompt, so exactly
  one document answers a question and every other document is a distractor;
- **prompt**: ``R :`` (the prefix), ``n_docs`` documents, then ``? KEY``; the **answer** is the
  value word(s). Training sequences carry ``train_questions`` questions after the documents
  (``? KEY VAL .`` each), and the loss is taken on the value words only. The first
  ``warm_steps`` steps train induction instead (a random word sequence seen once before, after a
  random gap: every position of the copy supervised), in batches of ``warm_batch``; the next
  ``long_steps`` the same copy at long range (gaps up to ``long_gaps``), then the task;
- **model**: ``LlamaForCausalLM``, default RoPE (the default preset: 3 layers, 4 heads, hidden 128);
- **held-out**: prompts drawn from a generator seeded apart from training's (``seed + 10_000``);
  the question names a key in a random document, so the answer may sit anywhere;
- **tokenizer**: a word-level ``tokenizers`` vocabulary over exactly these words (special tokens
  ``<|endoftext|>``, ``<|pad|>``), saved so ``AutoTokenizer`` loads it;
- **output**: a Hugging Face directory plus ``kdn_reference.json`` (``"task": "retrieval"``, the
  config, held-out accuracy with full prefill), written to a temporary sibling and renamed into
  place. Seeded: same config, interpreter and thread count give the same weights.

``kdn model train-reference --task retrieval [--preset default|tiny] [--out DIR]``; default
location ``$KDN_CACHE/retrieval-model``.

Why the recipe has three phases (each is needed on 2 CPU cores within the training budget):

- **induction, in batches of 128**: the task needs an induction head (match the key, copy the
  value after it). With 32 sequences a step the loss stays at ln(num_values) for 1,200 steps and
  more; with 128 it leaves that plateau at about 400 (3 layers: about 500);
- **induction at long range**: the first phase copies from 16-48 words back, while a question sits
  up to ~1,000 words after its fact, and the task alone does not stretch the reach; a copy a random
  distance up to 1,024 words back (one bound per step, 4,096-8,192 tokens a step) does;
- **the task**, 2-10 documents, then learns fast (the last steps with a decaying rate).

The default preset has 3 layers: with 2, blend's check layer (1) makes its recompute exact by
construction, so only a deeper model tests it. What it reaches (held-out accuracy with full
prefill, time on one thread) is written in ``kdn_reference.json`` and in ``docs/blend.md``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kdn.errors import InvalidInput
from kdn.lab.layout import EOS_TOKEN, META_FILE, PAD_TOKEN, cache_root, save_model
from kdn.lab.training import fit, new_llama

RETRIEVAL_DIRNAME = "retrieval-model"
# the default preset's phases (optimiser steps): induction, induction at long range, the task
WARM_STEPS, LONG_STEPS, TASK_STEPS = 600, 150, 200
PREFIX_TEXT = "R :"
HELDOUT_SEED_OFFSET = 10_000


def default_retrieval_dir(env: dict[str, str] | None = None) -> Path:
    return cache_root(env) / RETRIEVAL_DIRNAME


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """The task's shape (also what the eval draws held-out prompts from)."""

    num_keys: int = 128
    num_values: int = 128
    num_filler: int = 128
    doc_tokens: int = 128
    facts_per_doc: int = 10
    value_words: int = 2  # words per answer (a fact is ``KEY VAL.. .``)
    min_docs: int = 1
    max_docs: int = 10
    short_docs: int = 3  # training: most sequences hold 1..short_docs documents (cheap), the rest up to max_docs
    short_share: float = 0.7
    # curriculum: the first warm_steps steps train induction (copy a random word sequence seen
    # once before, every position of the copy supervised), the mechanism retrieval is built on;
    # without it the task's sparse answers leave the model on a plateau for hundreds of steps
    warm_steps: int = 150
    warm_len: int = 64
    warm_batch: int = 32  # sequences per warm-up step: induction forms only with big batches (less gradient noise)
    # then ``long_steps`` steps of the same induction at long range: the copy sits a random distance
    # up to one of ``long_gaps`` words after its original (the questions of an 8-document prompt sit
    # up to ~1,000 words after their facts; induction learned at distances <= 48 does not reach there),
    # ``long_tokens`` tokens a step (fewer, longer rows as the gap grows)
    long_steps: int = 0
    long_gaps: tuple[int, ...] = (64, 128, 256, 512, 1024)
    long_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.facts_per_doc * (self.value_words + 2) + 2 > self.doc_tokens:
            raise InvalidInput("facts do not fit in a document")
        if self.num_keys < self.max_docs * self.facts_per_doc:
            raise InvalidInput("not enough keys for unique keys per prompt")
        if self.long_steps and (not self.long_gaps or min(self.long_gaps) < 0):
            raise InvalidInput("long_gaps must be non-negative gap lengths")


@dataclass(frozen=True, slots=True)
class RetrievalTrainConfig:
    """Everything that decides the trained weights (written to ``kdn_reference.json``)."""

    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    max_positions: int = 2048
    batch_size: int = 16
    steps: int = 700
    lr: float = 3e-3
    warmup_steps: int = 30
    # schedule: the induction warm-up follows a cosine from ``lr`` over ``lr_horizon`` steps (0: all
    # ``steps``); if ``task_lr`` is set, the long-range warm-up runs at ``long_lr`` and the task at
    # ``task_lr``, both constant, with a cosine decay to 5% over the last ``decay_share`` of the task's steps
    lr_horizon: int = 0
    long_lr: float = 5e-4
    task_lr: float = 0.0
    decay_share: float = 0.2
    weight_decay: float = 0.05
    train_questions: int = 24
    eval_prompts: int = 200
    eval_docs: int = 8
    # One thread: on a shared 2-core machine two OpenMP threads spin-wait on each other and burn
    # 5-10x the CPU time per step (measured here: 6x250 tokens 0.12 CPU-s with 1 thread, 1.3-2.6 s with 2).
    threads: int = 1
    task: TaskConfig = TaskConfig()

    @classmethod
    def preset(cls, name: str) -> "RetrievalTrainConfig":
        if name == "default":  # 3 layers; induction in big batches, induction at long range, then the task
            return cls(hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=32,
                       batch_size=8, steps=WARM_STEPS + LONG_STEPS + TASK_STEPS, lr=3e-3, warmup_steps=30,
                       weight_decay=0.0, train_questions=32, lr_horizon=950, long_lr=5e-4, task_lr=3e-4,
                       task=TaskConfig(num_keys=128, num_values=64, num_filler=64, facts_per_doc=8, value_words=1,
                                       short_docs=1, short_share=0.0, warm_steps=WARM_STEPS, warm_len=16,
                                       warm_batch=128, long_steps=LONG_STEPS, long_tokens=4096))
        if name == "tiny":  # the same code path in seconds: tests (accuracy is not the point)
            return cls(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                       max_positions=512, batch_size=2, steps=4, warmup_steps=1, train_questions=4, eval_prompts=4,
                       eval_docs=3, threads=1,
                       task_lr=1e-3, task=TaskConfig(num_keys=64, num_values=16, num_filler=16, doc_tokens=32,
                                                     facts_per_doc=2, min_docs=2, max_docs=3, short_docs=2,
                                                     warm_steps=1, warm_len=8, warm_batch=4, long_steps=1,
                                                     long_gaps=(16, 32), long_tokens=96))
        raise InvalidInput(f"unknown preset {name!r}; choose default or tiny")


# -- the task -------------------------------------------------------------------------------------


def vocabulary(task: TaskConfig) -> list[str]:
    words = [EOS_TOKEN, PAD_TOKEN, "R", "D", ":", ".", "?"]
    words += [f"k{i}" for i in range(task.num_keys)]
    words += [f"v{i}" for i in range(task.num_values)]
    words += [f"f{i}" for i in range(task.num_filler)]
    return words


@dataclass(frozen=True, slots=True)
class Prompt:
    """One held-out prompt: documents (word lists), the question and its answer."""

    docs: tuple[tuple[str, ...], ...]
    question: tuple[str, ...]  # ("?", KEY)
    answer: tuple[str, ...]  # value_words VALs
    answer_doc: int


def _document(task: TaskConfig, keys: list[int], gen: torch.Generator) -> tuple[list[str], dict[int, tuple[int, ...]]]:
    """``D :`` then ``doc_tokens - 2`` words: facts at random slots among filler."""
    body = task.doc_tokens - 2
    n_fill = body - (task.value_words + 2) * len(keys)
    # choose where each fact starts among the filler: sorted distinct cut points
    cuts = sorted(torch.randperm(n_fill + 1, generator=gen)[: len(keys)].tolist())
    filler = torch.randint(0, task.num_filler, (n_fill,), generator=gen).tolist()
    words = ["D", ":"]
    facts: dict[int, tuple[int, ...]] = {}
    prev = 0
    for key, cut in zip(keys, cuts):
        words += [f"f{x}" for x in filler[prev:cut]]
        v = tuple(torch.randint(0, task.num_values, (task.value_words,), generator=gen).tolist())
        facts[key] = v
        words += [f"k{key}", *(f"v{x}" for x in v), "."]
        prev = cut
    words += [f"f{x}" for x in filler[prev:]]
    assert len(words) == task.doc_tokens
    return words, facts


def make_prompt(task: TaskConfig, n_docs: int, gen: torch.Generator, n_questions: int = 1) -> tuple[Prompt, list[tuple[int, tuple[int, ...]]]]:
    """Documents with unique keys, and ``n_questions`` (key, value) questions about them."""
    keys = torch.randperm(task.num_keys, generator=gen)[: n_docs * task.facts_per_doc].tolist()
    docs, all_facts = [], []
    for d in range(n_docs):
        words, facts = _document(task, keys[d * task.facts_per_doc : (d + 1) * task.facts_per_doc], gen)
        docs.append(tuple(words))
        all_facts += [(k, v, d) for k, v in facts.items()]
    order = torch.randperm(len(all_facts), generator=gen)[:n_questions].tolist()
    qs = [all_facts[i] for i in order]
    k, v, d = qs[0]
    prompt = Prompt(tuple(docs), ("?", f"k{k}"), tuple(f"v{x}" for x in v), d)
    return prompt, [(k, v) for k, v, _ in qs]


def heldout_prompts(task: TaskConfig, n: int, n_docs: int, seed: int) -> list[Prompt]:
    """``n`` held-out prompts (a generator seeded apart from training's)."""
    gen = torch.Generator().manual_seed(seed + HELDOUT_SEED_OFFSET)
    return [make_prompt(task, n_docs, gen)[0] for _ in range(n)]


def _train_batch(cfg: RetrievalTrainConfig, tok: Any, gen: torch.Generator, step: int = 1 << 30) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, S)`` input ids and ``(B, S)`` targets (-100 except the value words)."""
    task = cfg.task
    if step < task.warm_steps:
        # per row: noise(G - g) · seq(W) · noise(g) · seq(W), g random, so the copy sits at a random
        # distance (a fixed one would teach a positional head, not induction)
        W, G, B = task.warm_len, 2 * task.warm_len, task.warm_batch
        rows = []
        for _ in range(B):
            g = int(torch.randint(0, G + 1, (1,), generator=gen))
            seq = torch.randint(7, tok.get_vocab_size(), (W,), generator=gen)
            noise = torch.randint(7, tok.get_vocab_size(), (G,), generator=gen)
            rows.append(torch.cat((noise[: G - g], seq, noise[G - g :], seq)))
        return _copy_rows(rows, G, W)
    if step < task.warm_steps + task.long_steps:
        # the same at long range: one gap bound per step, as many rows as fit in long_tokens
        W = task.warm_len
        G = task.long_gaps[int(torch.randint(0, len(task.long_gaps), (1,), generator=gen))]
        rows = []
        for _ in range(max(1, task.long_tokens // (G + 2 * W))):
            g = int(torch.randint(0, G + 1, (1,), generator=gen))
            seq = torch.randint(7, tok.get_vocab_size(), (W,), generator=gen)
            noise = torch.randint(7, tok.get_vocab_size(), (G,), generator=gen)
            rows.append(torch.cat((noise[: G - g], seq, noise[G - g :], seq)))
        return _copy_rows(rows, G, W)
    if float(torch.rand((), generator=gen)) < task.short_share:
        n_docs = int(torch.randint(task.min_docs, min(task.short_docs, task.max_docs) + 1, (1,), generator=gen))
    else:
        n_docs = int(torch.randint(min(task.short_docs + 1, task.max_docs), task.max_docs + 1, (1,), generator=gen))
    seqs, tgts = [], []
    for _ in range(cfg.batch_size):
        prompt, qs = make_prompt(task, n_docs, gen, cfg.train_questions)
        words = PREFIX_TEXT.split() + [w for d in prompt.docs for w in d]
        labels = [False] * len(words)
        for k, v in qs:
            words += ["?", f"k{k}", *(f"v{x}" for x in v), "."]
            labels += [False, False, *(True for _ in v), False]
        ids = [tok.token_to_id(w) for w in words]
        seqs.append(ids)
        tgts.append([i if lab else -100 for i, lab in zip(ids, labels)])
    x = torch.tensor(seqs, dtype=torch.long)
    y = torch.tensor(tgts, dtype=torch.long)
    return x[:, :-1], y[:, 1:]


def _copy_rows(rows: list[torch.Tensor], G: int, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of induction rows ``noise · seq(W) · noise · seq(W)`` (G noise words in all)."""
    x = torch.stack(rows)  # (B, G + 2W)
    y = x.clone()
    y[:, : G + W + 1] = -100  # only the copy (after its first word) is predictable
    return x[:, :-1], y[:, 1:]


def build_tokenizer(task: TaskConfig) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(vocabulary(task))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def prompt_ids(tok: Any, prompt: Prompt) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """``(prefix, docs, question, answer)`` token ids of a prompt (word-level: one id per word)."""
    ids = lambda words: [tok.token_to_id(w) for w in words]  # noqa: E731
    return ids(PREFIX_TEXT.split()), [ids(d) for d in prompt.docs], ids(prompt.question), ids(prompt.answer)


@torch.no_grad()
def full_prefill_accuracy(model: Any, tok: Any, prompts: list[Prompt]) -> float:
    """Share of prompts whose answer words all come out greedily (teacher-forced on the earlier ones)."""
    model.eval()
    hits = 0
    for p in prompts:
        pre, docs, q, ans = prompt_ids(tok, p)
        ids = torch.tensor([pre + sum(docs, []) + q + ans[:-1]])  # (1, S)
        logits = model(input_ids=ids, logits_to_keep=len(ans)).logits[0]  # (len(ans), V)
        hits += int(logits.argmax(-1).tolist() == ans)
    model.train()
    return hits / max(1, len(prompts))


def _cosine(peak: float, progress: float) -> float:
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress)))))


def _lr_at(step: int, cfg: RetrievalTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    task = cfg.task
    if not cfg.task_lr or step < task.warm_steps:
        horizon = cfg.lr_horizon or cfg.steps
        return _cosine(cfg.lr, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    peak = cfg.long_lr if step < task.warm_steps + task.long_steps else cfg.task_lr
    task_steps = cfg.steps - task.warm_steps - task.long_steps
    decay_from = cfg.steps - max(1, round(cfg.decay_share * task_steps))
    return _cosine(peak, (step - decay_from) / max(1, cfg.steps - decay_from)) if step >= decay_from else peak


@dataclass(frozen=True, slots=True)
class RetrievalResult:
    out_dir: Path
    params: int
    steps: int
    final_loss: float
    heldout_accuracy: float
    heldout_prompts: int
    eval_docs: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


def train_retrieval(
    cfg: RetrievalTrainConfig,
    out_dir: Path,
    *,
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> RetrievalResult:
    """Train the retrieval reference model and save it as a Hugging Face directory."""
    t0 = time.perf_counter()
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        tok = build_tokenizer(cfg.task)
        torch.manual_seed(cfg.seed)
        model = new_llama(cfg, tok.get_vocab_size(), tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN))
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        log(f"retrieval model: {n_params / 1e6:.2f}M params, vocab {tok.get_vocab_size()}, {cfg.steps} steps")
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        ema = fit(model, steps=cfg.steps, lr=cfg.lr, weight_decay=cfg.weight_decay, lr_at=lambda s: _lr_at(s, cfg),
                  batch=lambda s: _train_batch(cfg, tok, gen, s), desc="train-retrieval", progress=progress)
        prompts = heldout_prompts(cfg.task, cfg.eval_prompts, cfg.eval_docs, cfg.seed)
        acc = full_prefill_accuracy(model, tok, prompts)
        result = RetrievalResult(Path(out_dir), n_params, cfg.steps, ema, acc, len(prompts), cfg.eval_docs,
                                 time.perf_counter() - t0)
        log(f"held-out accuracy with full prefill ({cfg.eval_docs} docs): {acc:.3f}")
        _save(model, tok, cfg, result, Path(out_dir))
        return result
    finally:
        torch.set_num_threads(prev_threads)


def _save(model: Any, tok: Any, cfg: RetrievalTrainConfig, result: RetrievalResult, out: Path) -> None:
    """Write next to ``out`` and rename into place (no half-written model is ever visible)."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                     pad_token=PAD_TOKEN, unk_token=PAD_TOKEN, model_max_length=1 << 30)
    meta = {
        "kind": "kdn-reference-model",
        "task": "retrieval",
        "train_config": asdict(cfg),
        "result": {k: v for k, v in result.as_dict().items() if k != "out_dir"},
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    save_model(out, model, hf_tok, meta)


def load_task(model_dir: Path) -> tuple[RetrievalTrainConfig, dict[str, Any]]:
    """The training config (and so the task) recorded with a retrieval model."""
    meta_path = Path(model_dir) / META_FILE
    if not meta_path.is_file():
        raise InvalidInput(f"{model_dir} has no {META_FILE}: not a KDN reference model")
    meta = json.loads(meta_path.read_text())
    if meta.get("task") != "retrieval":
        raise InvalidInput(f"{model_dir} is not a retrieval reference model (task={meta.get('task')!r})")
    tc = dict(meta["train_config"])
    task = dict(tc["task"])
    if "long_gaps" in task:
        task["long_gaps"] = tuple(task["long_gaps"])
    tc["task"] = TaskConfig(**task)
    return RetrievalTrainConfig(**tc), meta
