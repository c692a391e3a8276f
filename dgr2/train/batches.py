"""Tokenized training batches and a deterministic, resumable sampler.

Why a hand-written sampler: resume must never skip or repeat data.  The order of every epoch is
a pure function of (seed, epoch), each optimizer step consumes a fixed, contiguous slice of it,
and a checkpoint records only ``global_step``; so a restarted worker recomputes exactly where it
was, whatever the number of failures.  Each rank takes an interleaved share of the step's slice,
so the union over ranks is the global batch and no example is seen twice in an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

IGNORE_INDEX = -100


def tokenize_pairs(
    prompts: list[str], completions: list[str], tokenizer, max_length: int
) -> pa.Table:
    """Tokenize prompt/completion pairs into ``input_ids`` + ``prompt_len`` columns.

    Pairs longer than ``max_length`` are refused loudly rather than truncated: a truncated
    completion would teach the model to stop before ``</answer>``.
    """
    if len(prompts) != len(completions):
        raise ValueError("prompts and completions differ in length")
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    rows, lens = [], []
    for index, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if len(p) + len(c) > max_length:
            raise ValueError(
                f"example {index}: {len(p)} prompt + {len(c)} completion tokens > max_length {max_length}; "
                "raise model.max_position_embeddings or shorten histories"
            )
        rows.append(p + c)
        lens.append(len(p))
    return pa.table(
        {
            "input_ids": pa.array(rows, type=pa.list_(pa.int32())),
            "prompt_len": pa.array(lens, type=pa.int32()),
        }
    )


def write_tokenized(table: pa.Table, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


@dataclass
class TokenizedDataset:
    """In-memory token rows read from Parquet (small enough for every worker to hold)."""

    input_ids: list[np.ndarray]
    prompt_len: np.ndarray

    @classmethod
    def read(cls, path: Path) -> "TokenizedDataset":
        table = pq.read_table(path)
        ids = [np.asarray(row, dtype=np.int64) for row in table.column("input_ids").to_pylist()]
        return cls(ids, table.column("prompt_len").to_numpy().astype(np.int64))

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self.input_ids))


def collate(dataset: TokenizedDataset, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows; labels are the completion tokens only (prompt and padding ignored)."""
    length = max(len(dataset.input_ids[i]) for i in indices)
    input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(indices), length), dtype=torch.long)
    labels = torch.full((len(indices), length), IGNORE_INDEX, dtype=torch.long)
    prompt_len = torch.zeros(len(indices), dtype=torch.long)
    for row, index in enumerate(indices):
        ids = torch.from_numpy(dataset.input_ids[index])
        n, p = len(ids), int(dataset.prompt_len[index])
        input_ids[row, :n] = ids
        attention[row, :n] = 1
        labels[row, p:n] = ids[p:]
        prompt_len[row] = p
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels, "prompt_len": prompt_len}


@dataclass(frozen=True)
class StepSampler:
    """Which example indices rank ``rank`` uses for each micro-batch of optimizer step ``step``."""

    num_examples: int
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        steps = self.num_examples // self.global_batch
        if steps == 0:
            raise ValueError(
                f"{self.num_examples} examples < one global batch of {self.global_batch} "
                "(micro_batch_size x grad_accum_steps x num_workers)"
            )
        return steps

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """The ``grad_accum_steps`` micro-batches of ``rank`` for global optimizer step ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self.epoch_order(epoch)
        chunk = order[within * self.global_batch : (within + 1) * self.global_batch]
        mine = chunk[rank :: self.world_size]
        mbs = self.micro_batch_size
        return [mine[i * mbs : (i + 1) * mbs].tolist() for i in range(self.grad_accum_steps)]
