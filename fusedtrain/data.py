"""Corpus -> token array (tokenized once with `datasets`, cached, memory-mapped) -> windows.

Sources (`data.source`):
  stdlib     the running interpreter's own standard-library .py files (offline, everywhere)
  text       local text files (`data.files`)
  hub        a Hugging Face hub dataset (`data.name`), when the machine is online
  synthetic  uniform random tokens, for throughput runs

With `data.pack=true` each window also carries its documents (each ends with the
tokenizer's end-of-document token): cu_seqlens over the batch's flattened tokens, and
the targets that would predict the next document's first token are ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)

SOURCES = ("stdlib", "text", "hub", "synthetic")
TOKENIZERS = ("byte", "gpt2")
# GPT-2's pre-tokenizer split pattern (the public tiktoken definition).
_GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


@dataclass
class DataConfig:
    source: str = "stdlib"
    files: list[str] = field(default_factory=list)
    name: str | None = None  # hub dataset name
    split: str = "train"  # hub split
    text_column: str = "text"
    tokenizer: str = "byte"
    bpe_file: str | None = None  # a local gpt2.tiktoken ranks file, for tokenizer=gpt2
    max_files: int | None = None  # cap on corpus files (stdlib/text), e.g. for quick tests
    synthetic_tokens: int = 1 << 20
    val_fraction: float = 0.05
    val_batches: int = 8
    batch_size: int = 8
    num_workers: int = 0
    num_proc: int | None = None  # processes for tokenizing; None = min(4, cpus)
    cache_dir: str = "~/.cache/fusedtrain"
    allow_binary: bool = False  # take text files that look binary (NUL bytes, >1% undecodable)
    pack: bool = False  # windows carry their document boundaries (PackedWindows)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer must be one of {TOKENIZERS}, got {self.tokenizer!r}")
        if self.batch_size <= 0:
            raise ValueError(f"data.batch_size must be positive, got {self.batch_size}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.source == "text" and not self.files:
            raise ValueError("data.source=text needs data.files=[path, ...]")
        if self.source == "hub" and not self.name:
            raise ValueError("data.source=hub needs data.name=<dataset on the hub>")
        if self.pack and self.source == "synthetic":
            raise ValueError("data.pack=true needs documents, and data.source=synthetic has "
                             "none (use stdlib, text or hub)")
        if self.max_files is not None and self.max_files <= 0:
            raise ValueError(f"data.max_files must be positive, got {self.max_files}")
        if self.source == "text":
            for f in self.files:
                path = Path(f).expanduser()
                if not path.is_file():
                    raise ValueError(f"data.files: {str(path)!r} does not exist or is not a file")
                if path.stat().st_size == 0:
                    raise ValueError(f"data.files: {str(path)!r} is empty")
        if self.tokenizer == "gpt2" and not (self.bpe_file
                                             and Path(self.bpe_file).expanduser().is_file()):
            raise ValueError(
                f"data.tokenizer=gpt2 needs data.bpe_file pointing at a local gpt2.tiktoken "
                f"ranks file (got {self.bpe_file!r}); or use data.tokenizer=byte")


class DataError(RuntimeError):
    """A corpus could not be read or fetched; the message names the setting."""


# ---------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens: offline, exact round trip. Documents are joined by byte 0."""

    name = "byte"
    vocab_size = 256
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, from a local ranks file (no download)."""

    name = "gpt2"
    vocab_size = 50257
    eot = 50256

    def __init__(self, bpe_file: str):
        """bpe_file: checked to exist by DataConfig."""
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ValueError("data.tokenizer=gpt2 needs tiktoken: pip install tiktoken") from e
        self.bpe_file = str(Path(bpe_file).expanduser())
        self._enc = tiktoken.Encoding(
            name="gpt2", pat_str=_GPT2_PATTERN,
            mergeable_ranks=load_tiktoken_bpe(self.bpe_file),
            special_tokens={"<|endoftext|>": self.eot},
        )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


def make_tokenizer(cfg: DataConfig) -> ByteTokenizer | GPT2Tokenizer:
    return ByteTokenizer() if cfg.tokenizer == "byte" else GPT2Tokenizer(cfg.bpe_file)


# ---------------------------------------------------------------- corpus files


def stdlib_files() -> list[Path]:
    """The interpreter's standard-library .py sources, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(
        p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
    )


def corpus_files(cfg: DataConfig) -> list[Path]:
    if cfg.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"no standard-library sources found under {sys.prefix}")
    else:
        files = [Path(f).expanduser() for f in cfg.files]  # checked by DataConfig
    return files[: cfg.max_files] if cfg.max_files else files


def _cache_key(cfg: DataConfig, tok) -> str:
    h = hashlib.sha256()
    h.update(f"{cfg.source}|{tok.name}|{getattr(tok, 'bpe_file', '')}".encode())
    if cfg.allow_binary:  # a cache of files taken as text only with it
        h.update(b"|allow_binary")
    if cfg.source in ("stdlib", "text"):
        for f in corpus_files(cfg):
            st = f.stat()
            h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    elif cfg.source == "hub":
        h.update(f"{cfg.name}|{cfg.split}|{cfg.text_column}".encode())
    return h.hexdigest()[:20]


def _load_texts(cfg: DataConfig):
    import datasets

    if cfg.source == "hub":
        try:
            ds = datasets.load_dataset(cfg.name, split=cfg.split)
        except (ConnectionError, FileNotFoundError, ValueError) as e:
            raise DataError(f"data.name={cfg.name!r} (split {cfg.split!r}) could not be "
                            f"loaded: {type(e).__name__}: {str(e)[:300]}") from e
        if cfg.text_column not in ds.column_names:
            raise ValueError(
                f"data.text_column={cfg.text_column!r} not in {cfg.name!r}: {ds.column_names}"
            )
        return ds.select_columns([cfg.text_column]).rename_column(cfg.text_column, "text")
    texts = [_read_text(f, cfg) for f in corpus_files(cfg)]
    return datasets.Dataset.from_dict({"text": texts})


BINARY_SHARE = 0.01  # undecodable characters past this share make a file "not text"


def _read_text(path: Path, cfg: DataConfig) -> str:
    """A corpus file as UTF-8 text (undecodable bytes as U+FFFD); a user's file
    (data=text) that holds NUL bytes or more than 1% undecodable characters is refused
    (DataError naming it) unless data.allow_binary=true."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if cfg.source == "text" and not cfg.allow_binary:
        bad = text.count("\ufffd")
        if b"\0" in raw or bad > BINARY_SHARE * max(1, len(text)):
            why = "NUL bytes" if b"\0" in raw else f"{bad / len(text):.0%} undecodable"
            raise DataError(f"data.files: {str(path)!r} is not text ({why}); "
                            "data.allow_binary=true takes it anyway")
    return text


def build_token_cache(cfg: DataConfig) -> Path:
    """Tokenize the corpus once and store it as a flat uint16 array; return its path.

    Keyed by corpus (file names, sizes, mtimes or hub name) and tokenizer, so a
    second run with the same corpus memory-maps the cached array.
    """
    tok = make_tokenizer(cfg)
    cache_dir = Path(os.path.expanduser(cfg.cache_dir))
    path = cache_dir / f"tokens-{cfg.source}-{tok.name}-{_cache_key(cfg, tok)}.u16"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    texts = _load_texts(cfg)
    num_proc = cfg.num_proc or min(4, os.cpu_count() or 1)
    num_proc = num_proc if len(texts) >= 4 * num_proc else None

    def encode(batch):
        ids = [tok.encode(t) + [tok.eot] for t in batch["text"]]
        return {"ids": ids, "n": [len(i) for i in ids]}

    ds = texts.map(encode, batched=True, num_proc=num_proc, remove_columns=["text"],
                   desc=f"tokenizing ({tok.name})")
    total = int(np.sum(ds["n"]))
    if total < 2:
        raise ValueError(f"data.source={cfg.source}: the corpus has no text")
    tmp = path.with_suffix(".tmp")
    out = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(total,))
    pos = 0
    for batch in ds.iter(batch_size=1024):
        chunk = np.fromiter((t for ids in batch["ids"] for t in ids), dtype=np.uint16)
        out[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    out.flush()
    del out
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps(
        {"source": cfg.source, "tokenizer": tok.name, "tokens": total, "files": len(texts)}
    ))
    log.info("cached %d tokens at %s", total, path)
    return path


def load_tokens(cfg: DataConfig, vocab_size: int, seed: int) -> np.ndarray:
    """The whole corpus as a 1-D token array (memory-mapped unless synthetic)."""
    if cfg.source == "synthetic":
        rng = np.random.default_rng(seed)
        return rng.integers(0, vocab_size, size=cfg.synthetic_tokens, dtype=np.int64).astype(
            np.uint16 if vocab_size <= 65536 else np.int32
        )
    tok = make_tokenizer(cfg)
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"data.tokenizer={tok.name} has {tok.vocab_size} tokens but model.vocab_size is "
            f"{vocab_size}"
        )
    return np.memmap(build_token_cache(cfg), dtype=np.uint16, mode="r")


# ---------------------------------------------------------------- windows


class RandomWindows(Dataset):
    """Sample i is a window of T+1 tokens at a start drawn from (seed, i) alone, so
    any position in the stream of samples can be reproduced (resume)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, length: int):
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"the corpus split has {len(tokens)} tokens, fewer than a window of "
                f"{seq_len + 1}: shorten the sequence or use more data"
            )
        self.tokens, self.seq_len, self.seed, self.length = tokens, seq_len, seed, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = np.random.default_rng((self.seed, i)).integers(
            0, len(self.tokens) - self.seq_len - 1
        )
        w = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


IGNORE_INDEX = -100  # a target the loss leaves out (the cross-entropy ops' default)


class PackedWindows(RandomWindows):
    """RandomWindows whose samples also mark where documents start: sample i ->
    (x, y, starts), x, y: (T,) as RandomWindows', starts: (T,) bool, true at 0 and after
    each end-of-document token `eot` in x. y is IGNORE_INDEX where x holds `eot`: the
    first token of the next document is not predicted from the one before it. The first
    document of a window is usually the tail of one that began before it."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, length: int, eot: int):
        super().__init__(tokens, seq_len, seed, length)
        self.eot = eot

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        return x, *mark_documents(x, y, self.eot)


def mark_documents(x: torch.Tensor, y: torch.Tensor, eot: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y: (..., T) inputs and next-token targets -> (y with IGNORE_INDEX where x holds
    `eot`, starts: bool, true at 0 and after each `eot` along the last dim)."""
    ends = x == eot
    starts = torch.ones_like(ends)
    starts[..., 1:] = ends[..., :-1]
    return y.masked_fill(ends, IGNORE_INDEX), starts


def cu_seqlens_of(starts: torch.Tensor) -> torch.Tensor:
    """starts: (B, T) bool -> int32 (n + 1,): the flattened index of each of the n true
    entries (every row's first among them), then B * T."""
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    return torch.cat([first, first.new_tensor([starts.numel()])]).to(torch.int32)


def pack_collate(samples: list[tuple[torch.Tensor, ...]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PackedWindows' samples -> (x, y: (B, T), cu_seqlens): int32 (n + 1,), the first
    token of each of the batch's n documents in its B * T flattened tokens, then B * T;
    every row starts a document, so none crosses a row."""
    x, y, starts = (torch.stack(column) for column in zip(*samples))
    return x, y, cu_seqlens_of(starts)


class SkipSampler(torch.utils.data.Sampler):
    """Indices start + rank, start + rank + world, ... of one global sample stream.

    `start()` is asked each time an epoch's iterator is made, so the stream continues
    where training is, across a resume and across any epoch boundary Lightning draws.
    Under data parallelism each rank takes every world-th sample, so one step of W ranks
    with batch B covers the same B*W samples as one step of a single process with batch B*W.
    """

    def __init__(self, length: int, start: Callable[[], int], rank: int = 0, world: int = 1):
        self.length, self.start, self.rank, self.world = length, start, rank, world

    def __len__(self) -> int:
        return max(0, self.length - self.start() - self.rank + self.world - 1) // self.world

    def __iter__(self):
        return iter(range(self.start() + self.rank, self.length, self.world))


class TokenDataModule(L.LightningDataModule):
    def __init__(self, cfg: DataConfig, seq_len: int, vocab_size: int, seed: int,
                 max_steps: int):
        super().__init__()
        self.cfg, self.seq_len, self.vocab_size, self.seed = cfg, seq_len, vocab_size, seed
        self.max_steps = max(1, max_steps)
        self.resumed_at = (0, 0)  # (sample, step) of the checkpoint resumed from
        self.train_set: RandomWindows | None = None
        self.val_set: RandomWindows | None = None
        self._collate = pack_collate if cfg.pack else None

    def _ranks(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def position(self) -> int:
        """The next sample of the global stream: where the resumed checkpoint stood, plus
        the samples of every step taken since."""
        sample, step = self.resumed_at
        now = self.trainer.global_step if self.trainer is not None else step
        # max: asked before the trainer has restored its step, this is the resume point
        return sample + max(0, now - step) * self.cfg.batch_size * self._ranks()[1]

    def state_dict(self) -> dict:
        step = self.trainer.global_step if self.trainer is not None else 0
        return {"start_sample": self.position(), "step": step}

    def load_state_dict(self, state: dict) -> None:
        sample = int(state["start_sample"])
        step = state.get("step", sample // (self.cfg.batch_size * self._ranks()[1]))
        self.resumed_at = (sample, int(step))

    def prepare_data(self) -> None:
        if self.cfg.source != "synthetic":
            build_token_cache(self.cfg)

    def check_size(self) -> None:
        """Before any training: the corpus (tokenized and cached now, if not yet) holds one
        training and one validation window of seq_len + 1 tokens, or a ValueError says
        how many it has and names model.block_size and the corpus."""
        n = len(load_tokens(self.cfg, self.vocab_size, self.seed))
        if n - self._val_tokens(n) < self.seq_len + 2:
            where = (", ".join(self.cfg.files) if self.cfg.source == "text"
                     else f"data.source={self.cfg.source}")
            raise ValueError(
                f"the corpus ({where}) has {n} tokens, too few for a training and a "
                f"validation window of model.block_size={self.seq_len} (it needs at least "
                f"{self.seq_len + 2 + self._val_tokens(n)}); use a larger corpus or a "
                "smaller model.block_size")

    def _val_tokens(self, n: int) -> int:
        return max(int(n * self.cfg.val_fraction), self.seq_len + 2)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = load_tokens(self.cfg, self.vocab_size, self.seed)
        self.check_size()
        n_val = self._val_tokens(len(tokens))
        windows = RandomWindows
        if self.cfg.pack:
            eot = make_tokenizer(self.cfg).eot
            windows = functools.partial(PackedWindows, eot=eot)
            log.info("data.pack=true: rows of %d tokens with their documents (each ending "
                     "with token %d); attention, positions and the loss restart at each",
                     self.seq_len, eot)
        self.train_set = windows(tokens[:-n_val], self.seq_len, self.seed,
                                 self.max_steps * self.cfg.batch_size * self._ranks()[1])
        self.val_set = windows(tokens[-n_val:], self.seq_len, self.seed + 1,
                               self.cfg.val_batches * self.cfg.batch_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.cfg.batch_size,
            sampler=SkipSampler(len(self.train_set), self.position, *self._ranks()),
            num_workers=self.cfg.num_workers, pin_memory=torch.cuda.is_available(),
            drop_last=True, collate_fn=self._collate,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.cfg.batch_size,
                          num_workers=self.cfg.num_workers, drop_last=True,
                          collate_fn=self._collate)
