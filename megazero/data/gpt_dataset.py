"""GPT training samples from indexed datasets: split, pack, shuffle, blend; indices cached.

A split's documents, each epoch in its own seeded order, form one endless token stream;
sample k is stream tokens [k * seq_length, k * seq_length + seq_length + 1), so documents are
packed across their boundaries and consecutive samples share one token (the last input's
target). Samples are shuffled within consecutive blocks of about one epoch, each block with
its own seeded permutation. Nothing depends on how many samples are asked for, so sample i
is a pure function of (document lengths, seed, i): a resumed or longer run sees the same
samples in the same order. Blending picks, for sample i, the dataset whose share is furthest
behind its weight (a weighted round robin), again independent of the total.

Fine-tuning datasets carry a loss mask beside the tokens (PREFIX_loss_mask, written by
data_tools/preprocess_data.py --prompt-key/--completion-key): their samples are Examples,
tokens with the mask, and a label whose mask is 0 (a prompt token, padding) counts nothing in
the loss. By default each such sample is one example, from its first token: truncated to
seq_length + 1 tokens (with a warning counting them) or padded (padding never counts), so
examples never share a sample; with pack_examples they are packed like pretraining text.

The three index arrays (document order, sample starts, shuffle) are built by one rank
(is_builder=True) and cached as .npy files, keyed by a hash of what they depend on, beside
the data or in cache_dir; the other ranks memory-map them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence, Union

import numpy as np

from megazero.atomic import atomic_write, write_text
from megazero.data import DataError
from megazero.data.indexed import IndexedDataset, index_path, loss_mask_prefix, read_metadata
from megazero.data.tokenizer import build_tokenizer

# Bump when the index algorithm changes, so stale caches are never reused.
_INDEX_VERSION = 1


# --- parsing the data config -----------------------------------------------------------------


def parse_blend(prefixes: Sequence[Any] | str) -> tuple[list[str], list[float] | None]:
    """(paths, weights) from ["P1", "P2"] (weights None) or ["0.3", "P1", "0.7", "P2"].

    Entries may be numbers or strings (YAML gives floats for unquoted weights).
    """
    # A lone string is one prefix, not a sequence of one-character prefixes.
    items = [prefixes] if isinstance(prefixes, str) else [str(p) for p in prefixes]
    if not items:
        raise DataError("data.prefix is empty; give one or more dataset prefixes")
    if len(items) >= 2 and _is_number(items[0]):
        if len(items) % 2 or not all(_is_number(w) for w in items[::2]):
            raise DataError(f"data.prefix {items} mixes weights and paths; use [W1, P1, W2, P2, ...] or [P1, P2, ...]")
        weights = [float(w) for w in items[::2]]
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise DataError(f"data.prefix weights {weights} must be non-negative with a positive sum")
        return items[1::2], weights
    return items, None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    """Fractions for train/valid/test from a Megatron split string such as "969,30,1"."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not values or len(values) > 3 or any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(f"data.split {split!r} must be up to 3 non-negative numbers with a positive sum, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(num_documents: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges per split, rounded as Megatron-LM rounds them."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    excess = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
    return [(max(0, lo), max(0, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


# --- the index cache -------------------------------------------------------------------------


def _cached_arrays(
    cache_dir: str,
    stem: str,
    description: dict[str, Any],
    needed: int,
    is_builder: bool,
    build: Callable[[int], tuple[dict[str, np.ndarray], int]],
) -> dict[str, np.ndarray]:
    """Index arrays holding at least `needed` samples: loaded from the cache, or built and cached.

    `build(needed)` returns the arrays and how many samples they hold. Each file is written
    under a temporary name and renamed; the manifest is renamed last and marks the set complete.
    """
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    base = os.path.join(cache_dir, f"{stem}.{key}")
    manifest = f"{base}.json"
    try:
        with open(manifest, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):  # missing or unreadable: built again
        cached = None
    if cached is not None and cached["capacity"] >= needed:
        try:
            return {name: np.load(f"{base}.{name}.npy", mmap_mode="r") for name in cached["arrays"]}
        except (OSError, ValueError):
            if not is_builder:
                raise DataError(f"sample index cache {base}.*.npy is unreadable; delete it and rerun") from None
    elif not is_builder:
        state = "is missing" if cached is None else f"holds {cached['capacity']} samples but {needed} are needed"
        raise DataError(f"sample index cache {manifest} {state}; the builder rank (is_builder=True) must build it first")
    arrays, capacity = build(needed)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for name, array in arrays.items():
            with atomic_write(f"{base}.{name}.npy") as f:
                np.save(f, array)
        record = {"description": description, "capacity": capacity, "arrays": sorted(arrays)}
        write_text(manifest, json.dumps(record, indent=2))
    except OSError as e:
        raise DataError(f"cannot write the sample index cache in {cache_dir} ({e.strerror}); set data.cache_dir") from None
    return arrays


# --- samples and labels ----------------------------------------------------------------------

IGNORE_INDEX = -100
"""The label of a position that counts nothing in the loss (the model ignores labels < 0)."""


class Example(NamedTuple):
    """A sample of a dataset with a loss mask: seq_length + 1 tokens (int64) and, per token,
    whether it counts in the loss when it is a label (uint8, 1: yes)."""

    tokens: np.ndarray
    loss_mask: np.ndarray


Sample = Union[np.ndarray, Example]
"""What a dataset returns: seq_length + 1 tokens that all count, or an Example."""


def inputs_and_labels(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels), int64 [len(samples), seq_length]: labels are the inputs shifted by
    one, IGNORE_INDEX where an Example's mask is 0. Plain samples may mix with Examples."""
    rows = np.stack([s.tokens if isinstance(s, Example) else s for s in samples]).astype(np.int64)
    labels = rows[:, 1:].copy()  # never a view of rows (one row's slice is contiguous): inputs stay intact
    for row, sample in enumerate(samples):
        if isinstance(sample, Example):
            labels[row, sample.loss_mask[1:] == 0] = IGNORE_INDEX
    return np.ascontiguousarray(rows[:, :-1]), labels


def open_loss_mask(indexed: IndexedDataset) -> IndexedDataset | None:
    """The dataset's loss mask (PREFIX_loss_mask), or None when it has none; refuses a mask
    whose layout is not the dataset's."""
    prefix = loss_mask_prefix(indexed.prefix)
    if not os.path.exists(index_path(prefix)):
        return None
    mask = IndexedDataset(prefix)
    if mask.dtype != np.uint8 or not (np.array_equal(mask.sequence_lengths, indexed.sequence_lengths)
                                      and np.array_equal(mask.document_indices, indexed.document_indices)):
        raise DataError(
            f"loss mask {prefix!r} ({mask.dtype}, {len(mask)} sequences) does not match dataset {indexed.prefix!r} "
            f"({len(indexed)} sequences); make both again with data_tools/preprocess_data.py --prompt-key/--completion-key"
        )
    return mask


# --- one dataset -----------------------------------------------------------------------------


class GPTDataset:
    """Samples of seq_length + 1 tokens from documents [doc_lo, doc_hi) of one indexed dataset.

    len() is num_samples; ds[i] is an int64 array, or an Example when the dataset has a loss
    mask (loss_masked). With vocab_size given, a token id outside the vocabulary raises
    DataError instead of reaching the embedding.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_range: tuple[int, int],
        seq_length: int,
        seed: int,
        num_samples: int,
        cache_dir: str,
        is_builder: bool,
        vocab_size: int | None = None,
        pack_examples: bool = False,
    ) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.vocab_size = vocab_size
        self.loss_mask = open_loss_mask(indexed)
        self.loss_masked = self.loss_mask is not None
        self.one_example_per_sample = self.loss_masked and not pack_examples
        starts, lengths = indexed.document_spans()
        self.doc_starts = starts[doc_range[0] : doc_range[1]]
        self.doc_lengths = lengths[doc_range[0] : doc_range[1]]
        self.first_document = doc_range[0]  # doc_order's ids count from here in the indexed dataset
        self.tokens_per_epoch = int(self.doc_lengths.sum())
        if self.tokens_per_epoch == 0:
            raise DataError(f"dataset {indexed.prefix!r}: documents {doc_range} hold no tokens; check data.split")
        # A shuffle block is about one epoch of samples; the last block may be partly used.
        self.block = max(1, self.tokens_per_epoch // seq_length)
        description = {
            "version": _INDEX_VERSION,
            "seq_length": seq_length,
            "seed": seed,
            "documents": list(doc_range),
            "lengths_sha256": hashlib.sha256(np.ascontiguousarray(self.doc_lengths).tobytes()).hexdigest(),
        }
        stem = os.path.basename(indexed.prefix) + "_indexmap"
        build = functools.partial(self._packed_indices, seed)
        if self.one_example_per_sample:
            description["samples"] = "one example each"
            build = functools.partial(self._example_indices, seed)
            if is_builder:
                self._warn_truncated()
        arrays = _cached_arrays(cache_dir, stem, description, num_samples, is_builder, build)
        self.doc_order = arrays["doc_order"]
        self.sample_starts = arrays.get("sample_starts")
        self.shuffle = arrays.get("shuffle")

    def _example_indices(self, seed: int, needed: int) -> tuple[dict[str, np.ndarray], int]:
        """Sample k is example doc_order[k]: whole epochs of examples, each in its own seeded order."""
        epochs = max(1, math.ceil(needed / len(self.doc_lengths)))
        return {"doc_order": self._doc_order(seed, epochs)}, epochs * len(self.doc_lengths)

    def _warn_truncated(self) -> None:
        longer = int((self.doc_lengths > self.seq_length + 1).sum())
        if longer:
            print(f"warning: dataset {self.indexed.prefix!r}: {longer} of {len(self.doc_lengths)} examples are longer "
                  f"than seq_length + 1 ({self.seq_length + 1}) tokens and are truncated (their tail counts nothing); "
                  f"raise model.seq_length to keep them whole", file=sys.stderr, flush=True)

    def _packed_indices(self, seed: int, needed: int) -> tuple[dict[str, np.ndarray], int]:
        capacity = max(1, math.ceil(needed / self.block)) * self.block
        # Sample k needs stream tokens up to k * seq_length + seq_length inclusive.
        epochs = math.ceil((capacity * self.seq_length + 1) / self.tokens_per_epoch)
        doc_order = self._doc_order(seed, epochs)
        return {
            "doc_order": doc_order,
            "sample_starts": self._sample_starts(doc_order, capacity),
            "shuffle": self._shuffle(seed, capacity),
        }, capacity

    def _doc_order(self, seed: int, epochs: int) -> np.ndarray:
        """Each epoch's documents in an order seeded by (seed, epoch) alone."""
        n = len(self.doc_lengths)
        dtype = np.int32 if n < 2**31 else np.int64
        return np.concatenate([np.random.default_rng([seed, 0, e]).permutation(n).astype(dtype) for e in range(epochs)])

    def _sample_starts(self, doc_order: np.ndarray, capacity: int) -> np.ndarray:
        """(position in doc_order, token offset in that document) where each sample starts."""
        ends = np.cumsum(self.doc_lengths[doc_order], dtype=np.int64)
        positions = np.arange(capacity, dtype=np.int64) * self.seq_length
        # The document holding stream position p is the first whose end lies beyond p; empty
        # documents end where their predecessor does and are never chosen.
        which = np.searchsorted(ends, positions, side="right")
        offsets = positions - (ends[which] - self.doc_lengths[doc_order[which]])
        return np.stack([which, offsets], axis=1)

    def _shuffle(self, seed: int, capacity: int) -> np.ndarray:
        blocks = [
            b * self.block + np.random.default_rng([seed, 1, b]).permutation(self.block)
            for b in range(capacity // self.block)
        ]
        return np.concatenate(blocks).astype(np.int64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        if self.one_example_per_sample:
            return self._example(int(self.doc_order[i]))
        spans = self._packed_spans(i)
        sample = self._checked(np.concatenate([self.indexed.tokens[a:b] for a, b in spans]).astype(np.int64))
        if self.loss_mask is None:
            return sample
        return Example(sample, np.concatenate([self.loss_mask.tokens[a:b] for a, b in spans]))

    def _packed_spans(self, i: int) -> list[tuple[int, int]]:
        """[start, end) in the flat token array of each piece of packed sample i."""
        return [(start, end) for _, start, end in self._packed_pieces(i)]

    def _packed_pieces(self, i: int) -> list[tuple[int, int, int]]:
        """(document, start, end) of each piece of packed sample i: [start, end) in the flat token array."""
        assert self.sample_starts is not None and self.shuffle is not None  # packed samples
        position, offset = (int(v) for v in self.sample_starts[self.shuffle[i]])
        pieces, need = [], self.seq_length + 1
        while need:
            doc = int(self.doc_order[position])
            take = min(need, int(self.doc_lengths[doc]) - offset)
            start = int(self.doc_starts[doc]) + offset
            pieces.append((doc, start, start + take))
            need -= take
            position, offset = position + 1, 0
        return pieces

    def provenance(self, i: int) -> tuple[str, list[int]]:
        """(the indexed dataset's prefix, the ids of the documents sample i is cut from), to name a
        batch the trainer skips (train/rerun.py)."""
        if self.one_example_per_sample:
            return self.indexed.prefix, [self.first_document + int(self.doc_order[i])]
        return self.indexed.prefix, [self.first_document + doc for doc, start, end in self._packed_pieces(i) if end > start]

    def _example(self, doc: int) -> Example:
        """Example `doc` from its first token, truncated or padded (mask 0) to seq_length + 1.
        The mask's tokens lie where the dataset's do: same lengths, written back to back."""
        start, n = int(self.doc_starts[doc]), min(int(self.doc_lengths[doc]), self.seq_length + 1)
        tokens = np.zeros(self.seq_length + 1, dtype=np.int64)
        tokens[:n] = self.indexed.tokens[start : start + n]
        mask = np.zeros(self.seq_length + 1, dtype=np.uint8)
        assert self.loss_mask is not None  # one example per sample: fine-tuning data
        mask[:n] = self.loss_mask.tokens[start : start + n]
        return Example(self._checked(tokens), mask)

    def _checked(self, sample: np.ndarray) -> np.ndarray:
        if self.vocab_size is not None and sample.max() >= self.vocab_size:
            raise DataError(
                f"dataset {self.indexed.prefix!r} holds token id {int(sample.max())} >= model.vocab_size "
                f"{self.vocab_size}; raise model.vocab_size or re-run preprocessing with the model's tokenizer"
            )
        return sample


# --- blending --------------------------------------------------------------------------------


def blend_schedule(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, sample within that dataset) for blended samples 0 .. num_samples - 1.

    Dataset k's j-th sample is due at time (j + 1/2) / w_k; blended samples are all due
    samples in time order (ties to the lower k). Every prefix of the schedule is within one
    sample of its weights, and it never depends on num_samples.
    """
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    datasets, times = [], []
    for k, wk in enumerate(w):
        if wk <= 0:
            continue
        # No prefix of n samples holds more than w_k * n + (number of datasets) of dataset k.
        count = math.ceil(wk * num_samples) + len(w) + 1
        times.append((np.arange(count) + 0.5) / wk)
        datasets.append(np.full(count, k, dtype=np.int16 if len(w) < 2**15 else np.int32))
    all_datasets, all_times = np.concatenate(datasets), np.concatenate(times)
    order = np.lexsort((all_datasets, all_times))[:num_samples]
    dataset_index = all_datasets[order]
    sample_index = np.zeros(num_samples, dtype=np.int64)
    for k in range(len(w)):
        chosen = dataset_index == k
        sample_index[chosen] = np.arange(int(chosen.sum()))
    return dataset_index, sample_index


@dataclass(eq=False)  # compared and hashed by identity, as any dataset
class BlendedDataset:
    """Samples drawn from several datasets: sample i is datasets[dataset_index[i]][sample_index[i]]."""

    datasets: list[GPTDataset | None]
    dataset_index: np.ndarray
    sample_index: np.ndarray
    num_samples: int

    def __post_init__(self) -> None:
        self.loss_masked = any(d is not None and d.loss_masked for d in self.datasets)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        dataset = self.datasets[int(self.dataset_index[i])]
        assert dataset is not None  # only datasets with samples are indexed
        return dataset[int(self.sample_index[i])]

    def provenance(self, i: int) -> tuple[str, list[int]]:
        """Sample i's dataset and document ids (GPTDataset.provenance)."""
        dataset = self.datasets[int(self.dataset_index[i])]
        assert dataset is not None  # only datasets with samples are indexed
        return dataset.provenance(int(self.sample_index[i]))


# --- building the three splits ---------------------------------------------------------------


def build_train_valid_test_datasets(
    prefixes: Sequence[Any],
    split: str,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    cache_dir: str | None,
    is_builder: bool,
    vocab_size: int | None = None,
    pack_examples: bool = False,
) -> tuple[GPTDataset | BlendedDataset | None, ...]:
    """(train, valid, test): each has len() and ds[i] -> int64 array of seq_length + 1 tokens
    (an Example for a dataset with a loss mask; pack_examples packs those across examples).

    A split is None when its fraction rounds to no documents or no samples are asked of it.
    Without weights, datasets are blended in proportion to their tokens in that split.
    is_builder=True builds and caches the indices (call it on one rank, then a barrier);
    is_builder=False only loads them and fails if they are missing. Indices are cached in
    cache_dir, or beside each dataset when it is None.
    """
    paths, weights = parse_blend(prefixes)
    fractions = parse_split(split)
    indexed = [IndexedDataset(p) for p in paths]

    def dataset(ds: IndexedDataset, doc_range: tuple[int, int], n: int) -> GPTDataset:
        return GPTDataset(ds, doc_range, seq_length, seed, n, cache_dir or _beside(ds), is_builder, vocab_size,
                          pack_examples)

    result: list[GPTDataset | BlendedDataset | None] = []
    for s in range(3):
        if num_samples[s] <= 0 or fractions[s] == 0:
            result.append(None)
            continue
        ranges = [split_document_ranges(ds.num_documents, fractions)[s] for ds in indexed]
        result.append(_build_split(indexed, ranges, weights, num_samples[s], cache_dir or _beside(indexed[0]),
                                   is_builder, dataset))
    return tuple(result)


def _build_split(
    indexed: list[IndexedDataset],
    ranges: list[tuple[int, int]],
    weights: list[float] | None,
    num_samples: int,
    blend_dir: str,
    is_builder: bool,
    dataset: Callable[[IndexedDataset, tuple[int, int], int], GPTDataset],
) -> GPTDataset | BlendedDataset | None:
    if weights is None:
        # Weight by tokens in the split, as if the datasets were concatenated.
        weights = [float(ds.document_spans()[1][lo:hi].sum()) for ds, (lo, hi) in zip(indexed, ranges)]
    weights = [w if hi > lo else 0.0 for w, (lo, hi) in zip(weights, ranges)]
    if sum(weights) <= 0:
        return None
    if len(indexed) == 1:
        return dataset(indexed[0], ranges[0], num_samples)

    def build(needed: int) -> tuple[dict[str, np.ndarray], int]:
        dataset_index, sample_index = blend_schedule(weights, needed)
        return {"dataset_index": dataset_index, "sample_index": sample_index}, needed

    # The schedule depends on the weights alone, so that is all its cache key holds.
    total = sum(weights)
    description = {"version": _INDEX_VERSION, "weights": [w / total for w in weights]}
    arrays = _cached_arrays(blend_dir, "blend", description, num_samples, is_builder, build)
    dataset_index, sample_index = arrays["dataset_index"][:num_samples], arrays["sample_index"][:num_samples]
    counts = np.bincount(dataset_index, minlength=len(indexed))
    datasets = [dataset(ds, rng, int(n)) if n else None for ds, rng, n in zip(indexed, ranges, counts)]
    return BlendedDataset(datasets, dataset_index, sample_index, num_samples)


def _beside(ds: IndexedDataset) -> str:
    return os.path.dirname(os.path.abspath(ds.prefix))


# --- compatibility of data, tokenizer and model ----------------------------------------------


def check_compatibility(prefixes: Sequence[Any] | None, tokenizer_spec: str | None, model_vocab_size: int) -> None:
    """Refuse data made with another tokenizer, or holding ids the model's vocabulary lacks.

    O(1) per dataset: it reads the .meta.json sidecar written at preprocessing. A dataset
    without one (e.g. made by Megatron-LM) cannot be checked here; GPTDataset's per-sample
    check (vocab_size) still stops an out-of-range id.
    """
    tokenizer = None
    if tokenizer_spec:
        tokenizer = build_tokenizer(tokenizer_spec)
        if tokenizer.vocab_size > model_vocab_size:
            raise DataError(
                f"data.tokenizer {tokenizer_spec!r} has {tokenizer.vocab_size} tokens but model.vocab_size "
                f"is {model_vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size}"
            )
    paths, _ = parse_blend(prefixes or [])
    seen: tuple[str, dict[str, Any]] | None = None
    for path in paths:
        IndexedDataset(path)  # the files exist and agree with each other
        meta = read_metadata(path)
        if meta is None:
            continue
        identity = meta.get("tokenizer") or {}
        if tokenizer is not None:
            _check_same_tokenizer(path, identity, f"data.tokenizer {tokenizer_spec!r}", tokenizer.identity())
        if seen is not None:
            _check_same_tokenizer(path, identity, f"dataset {seen[0]!r}", seen[1])
        seen = (path, identity)
        max_id = int(meta.get("max_token_id", -1))
        if max_id >= model_vocab_size:
            raise DataError(
                f"dataset {path!r} holds token id {max_id} but model.vocab_size is {model_vocab_size}; "
                f"set model.vocab_size to at least {max(max_id + 1, int(identity.get('vocab_size', 0)))}"
            )
        if int(identity.get("vocab_size", 0)) > model_vocab_size:
            raise DataError(
                f"dataset {path!r} was made with a {identity['vocab_size']}-token vocabulary but "
                f"model.vocab_size is {model_vocab_size}; set model.vocab_size to at least {identity['vocab_size']}"
            )


def same_tokenizer(identity: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two tokenizer identities (Tokenizer.identity(), as sidecars store them) are the
    same tokenizer: same kind, size and file bytes, wherever the files are."""
    return all(identity.get(f) == other.get(f) for f in ("type", "vocab_size", "sha256"))


def _check_same_tokenizer(path: str, identity: dict[str, Any], other_name: str, other: dict[str, Any]) -> None:
    if same_tokenizer(identity, other):
        return
    mine, theirs = (f"{i.get('type')} vocab {i.get('vocab_size')} sha256 {str(i.get('sha256'))[:12]}" for i in (identity, other))
    raise DataError(
        f"dataset {path!r} was tokenized with {mine} but {other_name} is {theirs}; use the same "
        f"tokenizer, or re-run data_tools/preprocess_data.py with it"
    )
