"""Training data for TTT: JSONL records -> token ids + loss masks -> fixed-shape batches.

Record formats (one JSON object per line):

- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}``
- plain text: ``{"text": str, "prompt": str (optional)}``; the prompt prefix is not trained on.

Chats are rendered with the target tokenizer's own chat template, whatever it is; the loss mask is
exactly the assistant tokens (each reply and its end-of-turn token): from the template's
``{% generation %}`` markers where it has them, else found by rendering the conversation prefix by
prefix (``eagle_jax.training.chat``). Samples longer than ``max_length`` are dropped (and counted),
never truncated: a truncated conversation teaches the drafter to stop mid-turn.

Batching is deterministic: the order of epoch e is a function of (seed, e) only, so a data position
(epoch, index of the next batch) is all a resumed run needs to continue exactly where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from eagle_jax.training.chat import (  # noqa: F401 - chat names stay importable from here
    CHAT_ROLES,
    SHAREGPT_ROLES,
    DataError,
    chat_ids_and_mask,
    check_chat_template,
    messages_of,
)


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L], 1 = train on this token

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class DataStats:
    records: int = 0
    kept: int = 0
    too_long: int = 0  # longer than max_length: dropped
    no_loss: int = 0  # no assistant / text token to learn: dropped
    tokens: int = 0
    loss_tokens: int = 0

    def summary(self) -> str:
        return (
            f"{self.kept}/{self.records} samples kept ({self.too_long} over max length, {self.no_loss} with no "
            f"loss tokens dropped); {self.tokens} tokens, {self.loss_tokens} with loss"
        )


def encode_chat(messages: list[dict[str, str]], tokenizer: Any, where: str = "record") -> Sample:
    """The conversation's ids with the assistant tokens masked (``chat.chat_ids_and_mask``)."""
    ids, mask = chat_ids_and_mask(messages, tokenizer, where)
    return Sample(ids, mask)


def encode_text(text: str, tokenizer: Any, prompt: str | None = None) -> Sample:
    """``prompt`` (unmasked) then ``text`` (masked); special tokens (e.g. BOS) only at the very start."""
    head = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
    body = tokenizer(text, add_special_tokens=not prompt)["input_ids"]
    ids = np.asarray(list(head) + list(body), np.int32)
    mask = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(body), np.uint8)])
    return Sample(ids, mask)


def encode_record(record: dict, tokenizer: Any, where: str = "record") -> Sample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    messages = messages_of(record, where)
    if messages is not None:
        return encode_chat(messages, tokenizer, where)
    if isinstance(record.get("text"), str):
        prompt = record.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise DataError(f"{where}: 'prompt' must be a string")
        return encode_text(record["text"], tokenizer, prompt)
    raise DataError(f"{where}: needs 'messages', 'conversations' or 'text'; has keys {sorted(record)}")


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(``file:line``, record) for every non-empty line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file not found")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e})") from e


def load_samples(
    paths: str | Path | Iterable[str | Path],
    tokenizer: Any,
    max_length: int,
    *,
    progress: bool = True,
) -> tuple[list[Sample], DataStats]:
    """Tokenises JSONL files; drops (and counts) samples over ``max_length`` or without loss tokens."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    stats = DataStats()
    samples: list[Sample] = []
    template_checked = False
    for path in paths:
        for where, record in tqdm(
            read_jsonl(path), desc=f"tokenizing {Path(path).name}", unit=" rec", disable=not progress
        ):
            stats.records += 1
            if (
                not template_checked
                and isinstance(record, dict)
                and ("messages" in record or "conversations" in record)
            ):
                check_chat_template(tokenizer, f"tokenizer for {where}")
                template_checked = True
            s = encode_record(record, tokenizer, where)
            if len(s) > max_length:
                stats.too_long += 1
            elif not s.loss_mask.any():
                stats.no_loss += 1
            else:
                samples.append(s)
                stats.kept += 1
                stats.tokens += len(s)
                stats.loss_tokens += int(s.loss_mask.sum())
    return samples, stats


# -------------------------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: ``index`` = the next batch of epoch ``epoch``."""

    epoch: int = 0
    index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "DataPosition":
        return cls(int(d["epoch"]), int(d["index"]))


BATCHING_MODES = ("pad", "bucket", "pack")


def default_buckets(max_length: int, count: int = 4, multiple: int = 16) -> tuple[int, ...]:
    """``count`` lengths halving down from max_length, rounded up to ``multiple`` (few shapes to compile)."""
    out = {max_length}
    for k in range(1, count):
        out.add(min(max_length, -(-max(max_length >> k, 1) // multiple) * multiple))
    return tuple(sorted(out))


def first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Item indices packed into bins of ``capacity``: each item, in order, into the first bin with room.

    A max-tree over the bins' free space finds that bin in O(log n) (a linear scan over the open bins
    is quadratic on a large data set). Bins not yet opened are full-capacity leaves to the right of
    the open ones, so the leftmost fit is an open bin or the next new one. Every length <= capacity.
    """
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    free = [capacity] * (2 * size)  # node k: the most free space of any bin below it; leaves size..2*size-1
    bins: list[list[int]] = []
    for item, need in enumerate(lengths.tolist()):
        node = 1
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        if node - size == len(bins):
            bins.append([])
        bins[node - size].append(item)
        free[node] -= need
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return bins


def collate(samples: list[Sample], rows: list[np.ndarray], length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rows of ``length`` tokens, row r holding the samples ``rows[r]`` back to back, then padding.

    Returns input_ids (``pad_id`` after the samples), loss_mask (0 on padding), positions (0, 1, ...
    restarting at each sample; the row index on the padding) and segment_ids (1, 2, ... for the row's
    samples, 0 = padding), all [rows, length]. One sample per row: positions = arange, segment 1.
    """
    ids = np.full((len(rows), length), pad_id, np.int32)
    mask = np.zeros((len(rows), length), np.float32)
    positions = np.tile(np.arange(length, dtype=np.int32), (len(rows), 1))
    segments = np.zeros((len(rows), length), np.int32)
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, 1):
            s = samples[i]
            end = start + len(s)
            ids[r, start:end] = s.input_ids
            mask[r, start:end] = s.loss_mask
            positions[r, start:end] = np.arange(len(s), dtype=np.int32)
            segments[r, start:end] = seg
            start = end
    return {"input_ids": ids, "loss_mask": mask, "positions": positions, "segment_ids": segments}


@dataclass
class Batcher:
    """Deterministic batches of ``batch_size`` rows.

    mode "pad": one sample per row, every batch padded to ``max_length`` (one shape). mode "bucket":
    each sample goes to the smallest bucket length that holds it, batches are drawn within a bucket
    and padded to its length, and the batch order is shuffled across buckets. mode "pack": several
    samples (documents) per row of ``max_length``, first-fit over the epoch's shuffled order, rows
    shuffled again before they are cut into batches; positions restart and segment ids count up at
    each document (``collate``), so the train step keeps documents apart. Incomplete batches are
    dropped (fixed shapes), so a few samples per epoch are skipped (pack: those of the last fewer
    than ``batch_size`` rows); the epoch's order is reshuffled with (seed, epoch). Pack mode's batch
    count depends on the epoch's packing: ``num_batches(epoch)``.
    """

    samples: list[Sample]
    batch_size: int
    max_length: int
    mode: str = "pad"
    buckets: tuple[int, ...] | None = None
    seed: int = 0
    pad_id: int = 0
    _plans: dict[int, list[tuple[int, list[np.ndarray]]]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in BATCHING_MODES:
            raise DataError(
                "batching mode must be 'pad' or 'bucket' (one sample per row) or 'pack' (several per row), got "
                f"{self.mode!r}"
            )
        if self.mode == "bucket":
            self.buckets = tuple(sorted(self.buckets or default_buckets(self.max_length)))
            if self.buckets[-1] < self.max_length:
                raise DataError(f"largest bucket {self.buckets[-1]} < max_length {self.max_length}")
        elif self.buckets and tuple(self.buckets) != (self.max_length,):
            raise DataError(
                f"buckets {list(self.buckets)} are for batching mode 'bucket'; mode {self.mode!r} pads every row to "
                "max_length"
            )
        else:
            self.buckets = (self.max_length,)
        self._lengths = np.array([len(s) for s in self.samples], np.int64)
        if self._lengths.size and self._lengths.max() > self.max_length:
            i = int(np.argmax(self._lengths))
            raise DataError(f"sample {i} has {self._lengths[i]} tokens > max_length {self.max_length}")
        self._which = np.searchsorted(np.asarray(self.buckets), self._lengths, side="left")
        if self.mode == "pack":
            self._num_batches = len(self.plan(0))
        else:
            counts = np.bincount(self._which, minlength=len(self.buckets))
            self._num_batches = int(sum(c // self.batch_size for c in counts))
        if self._num_batches == 0:
            rows = "rows" if self.mode == "pack" else "samples"
            raise DataError(f"{len(self.samples)} samples do not fill one batch of {self.batch_size} {rows}")

    @property
    def batches_per_epoch(self) -> int:
        """Batches of every epoch; pack mode: of epoch 0 (``num_batches`` for another epoch)."""
        return self._num_batches

    def num_batches(self, epoch: int) -> int:
        return len(self.plan(epoch)) if self.mode == "pack" else self._num_batches

    def plan(self, epoch: int) -> list[tuple[int, list[np.ndarray]]]:
        """[(padded length, the sample indices of each row)] for every batch of ``epoch``."""
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, epoch])
            if self.mode == "pack":
                batches = self._pack(rng)
            else:
                batches = []
                for b, length in enumerate(self.buckets):
                    idx = rng.permutation(np.nonzero(self._which == b)[0])
                    n = len(idx) // self.batch_size
                    batches += [
                        (length, list(idx[k * self.batch_size : (k + 1) * self.batch_size, None])) for k in range(n)
                    ]
            order = rng.permutation(len(batches))
            self._plans = {epoch: [batches[k] for k in order]}  # keep one epoch: the plan is cheap to redo
        return self._plans[epoch]

    def _pack(self, rng: np.random.Generator) -> list[tuple[int, list[np.ndarray]]]:
        """Batches of packed rows: first-fit over a shuffled order, rows shuffled (the dropped tail too)."""
        order = rng.permutation(len(self.samples))
        rows = [order[np.asarray(b)] for b in first_fit(self._lengths[order], self.max_length)]
        rows = [rows[k] for k in rng.permutation(len(rows))]
        n = len(rows) // self.batch_size
        return [(self.max_length, rows[k * self.batch_size : (k + 1) * self.batch_size]) for k in range(n)]

    def batch(self, pos: DataPosition) -> dict[str, np.ndarray]:
        """input_ids, loss_mask, positions, segment_ids [batch_size, length] (``collate``)."""
        length, rows = self.plan(pos.epoch)[pos.index]
        return collate(self.samples, rows, length, self.pad_id)

    def next_position(self, pos: DataPosition) -> DataPosition:
        if pos.index + 1 < self.num_batches(pos.epoch):
            return DataPosition(pos.epoch, pos.index + 1)
        return DataPosition(pos.epoch + 1, 0)

    def iterate(self, start: DataPosition = DataPosition()) -> Iterator[tuple[DataPosition, dict[str, np.ndarray]]]:
        """Endless (position of this batch, batch) from ``start`` on, across epochs."""
        pos = start
        if pos.index >= self.num_batches(pos.epoch):
            pos = DataPosition(pos.epoch + 1, 0)
        while True:
            yield pos, self.batch(pos)
            pos = self.next_position(pos)


# ------------------------------------------------------------------------------------ synthetic data


def greedy_samples(
    target: Any, num_samples: int, prompt_length: int, length: int, *, seed: int = 0, batch_size: int = 64
) -> list[Sample]:
    """Random prompts continued greedily by ``target`` to ``length`` tokens; loss on the continuation.

    A stand-in for regenerated data when there is no tokenizer or corpus (tiny recipes and tests):
    the continuations are the target's own, which is what the drafter must learn to predict.
    """
    from eagle_jax.generate import generate  # the inference engine's plain decoding, KV cache and all

    rng = np.random.default_rng(seed)
    vocab = target.config.vocab_size
    out: list[Sample] = []
    mask = np.concatenate([np.zeros(prompt_length, np.uint8), np.ones(length - prompt_length, np.uint8)])
    for start in range(0, num_samples, batch_size):
        n = min(batch_size, num_samples - start)
        prompts = rng.integers(0, vocab, (batch_size, prompt_length)).tolist()  # full batches: one compiled program
        replies = generate(target, None, prompts, max_new_tokens=length - prompt_length, eos_token_id=[]).tokens
        out += [Sample(np.asarray(p + r, np.int32), mask.copy()) for p, r in zip(prompts[:n], replies)]
    return out
