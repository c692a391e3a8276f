"""Ray Train + DeepSpeed harness: deterministic resumable sampling, checkpoints, a real 2-worker run."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from dgr2.testing.word_tokenizer import word_tokenizer
from dgr2.config import ModelConfig, TrainConfig
from dgr2.train.batches import StepSampler, TokenizedDataset, collate, tokenize_pairs, write_tokenized
from dgr2.train.checkpoint import CorruptCheckpointError, latest_good_checkpoint, verify_checkpoint, write_state


def test_sampler_covers_each_epoch_once_and_is_resumable():
    sampler = StepSampler(num_examples=103, micro_batch_size=4, grad_accum_steps=2, world_size=3, seed=7)
    assert sampler.steps_per_epoch == 103 // 24
    seen = []
    for step in range(sampler.steps_per_epoch):
        for rank in range(3):
            for mb in sampler.micro_batches(step, rank):
                seen.extend(mb)
    assert len(seen) == len(set(seen)) == sampler.steps_per_epoch * 24
    # A "restarted" sampler (fresh object) yields exactly the same batches for a given step.
    again = StepSampler(103, 4, 2, 3, 7)
    assert again.micro_batches(3, 1) == sampler.micro_batches(3, 1)
    # Epochs are reshuffled.
    assert not np.array_equal(sampler.epoch_order(0), sampler.epoch_order(1))


def test_sampler_refuses_dataset_smaller_than_a_batch():
    with pytest.raises(ValueError, match="global batch"):
        _ = StepSampler(5, 4, 1, 2, 0).steps_per_epoch


def test_collate_masks_prompt_and_padding(tmp_path):
    tok = word_tokenizer(tmp_path / "tok")
    table = tokenize_pairs(["<s> w1 w2", "<s> w3"], ["w4 </s>", "w5 w6 w7 </s>"], tok, 16)
    write_tokenized(table, tmp_path / "d.parquet")
    data = TokenizedDataset.read(tmp_path / "d.parquet")
    batch = collate(data, [0, 1], tok.pad_token_id)
    assert batch["labels"][0].tolist() == [-100, -100, -100, tok.convert_tokens_to_ids("w4"), 3, -100]
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_pairs(["<s> w1 w2"], ["w3 w4 </s>"], tok, 4)


def test_corrupt_checkpoint_is_detected_and_skipped(tmp_path):
    good, bad = tmp_path / "a", tmp_path / "b"
    for step, path in ((1, good), (2, bad)):
        (path / "model").mkdir(parents=True)
        (path / "model" / "model.safetensors").write_bytes(b"weights" * 10)
        write_state(path, {"global_step": step})
    assert verify_checkpoint(good)["global_step"] == 1
    with open(bad / "model" / "model.safetensors", "r+b") as handle:
        handle.truncate(5)
    with pytest.raises(CorruptCheckpointError, match="corrupt or truncated"):
        verify_checkpoint(bad)
    assert latest_good_checkpoint([good, bad]) == good


class _FlakyController:
    """Stands in for a TorchTrainer: ``fit`` raises ControllerError for the first ``failures`` trainers."""

    def __init__(self, failures: int):
        self.failures, self.made = failures, 0

    def __call__(self):
        from ray.train import ControllerError

        self.made += 1
        made = self.made

        class Trainer:
            def fit(inner):
                if made <= self.failures:
                    raise ControllerError(RuntimeError(f"placement group removed (trainer {made})"))
                return f"result of trainer {made}"

        return Trainer()


def test_controller_errors_restart_a_fresh_trainer_then_give_up(capsys):
    from ray.train import ControllerError

    from dgr2.train.harness import fit_retrying_controller_errors

    flaky = _FlakyController(failures=2)
    assert fit_retrying_controller_errors(flaky, retries=2, stage="cft") == "result of trainer 3"
    assert flaky.made == 3  # a new trainer per attempt: it resumes from the checkpoint in storage
    out = capsys.readouterr().out
    assert "[cft] Ray Train controller failed (RuntimeError: placement group removed (trainer 1))" in out
    assert "retry 2/2" in out
    always = _FlakyController(failures=5)
    with pytest.raises(ControllerError, match="trainer 2"):
        fit_retrying_controller_errors(always, retries=1, stage="cft")
    assert always.made == 2
    # worker errors are Ray Train's own business (FailureConfig.max_failures), never retried here
    made = []

    def worker_error():
        made.append(1)

        class Trainer:
            def fit(self):
                raise ValueError("a bug in the training loop")

        return Trainer()

    with pytest.raises(ValueError, match="bug"):
        fit_retrying_controller_errors(worker_error, retries=3, stage="cft")
    assert len(made) == 1


def test_deepspeed_skips_its_shm_comm_op_instead_of_compiling_it(monkeypatch):
    """The CPU shared-memory all-reduce op (inference only) is marked off before DeepSpeed starts,
    so its comm backend gets no op and nothing is compiled; a renamed op fails here, not slowly."""
    import importlib

    import deepspeed.ops

    from dgr2.train.harness import SHM_COMM_OP, skip_deepspeed_shm_comm_op

    assert SHM_COMM_OP in deepspeed.ops.__compatible_ops__  # DeepSpeed still names the op this way
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, SHM_COMM_OP, deepspeed.ops.__compatible_ops__[SHM_COMM_OP])
    skip_deepspeed_shm_comm_op()
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None


@pytest.mark.slow
def test_two_worker_deepspeed_training_reduces_loss(tmp_path, ray_session):
    from dgr2.train.harness import StageJob, run_stage

    tok = word_tokenizer(tmp_path / "tok")
    rng = random.Random(0)
    prompts, completions = [], []
    for _ in range(192):
        seq = [f"w{rng.randrange(12)}" for _ in range(6)]
        prompts.append("<s> " + " ".join(seq))
        completions.append(" ".join(seq) + " </s>")  # copy task: learnable in a few steps
    write_tokenized(tokenize_pairs(prompts, completions, tok, 32), tmp_path / "data.parquet")
    train = TrainConfig(
        num_workers=2, zero_stage=2, micro_batch_size=8, epochs=10, max_steps=24, log_every=4,
        checkpoint_every=12, warmup_steps=2, lr=3e-3,
    )
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=64)
    job = StageJob(
        stage="harness-test", loss="sft", train=train.model_dump(), model=model.model_dump(),
        tokenizer_dir=str(tmp_path / "tok"), data_path=str(tmp_path / "data.parquet"),
        storage_dir=str(tmp_path / "ray"),
    )
    result = run_stage(job)
    losses = [row["train/loss"] for row in result.metrics["history"]]
    assert len(losses) == 6
    assert losses[-1] < losses[0] * 0.9, losses
    state = verify_checkpoint(result.checkpoint_dir)
    assert state["global_step"] == 24 and state["world_size"] == 2
    assert (result.model_dir / "model.safetensors").is_file()
    assert list((result.checkpoint_dir / "ds" / "state").glob("zero_pp_rank_1_*optim_states.pt"))


@pytest.mark.slow
def test_cft_block_diffusion_loss_trains_under_the_same_harness(tmp_path, ray_session):
    """CFT plugs into the harness as a loss: the AR model seen as block diffusion, 2 workers."""
    from dgr2.config import DiffusionConfig
    from dgr2.train.harness import StageJob, run_stage

    tok = word_tokenizer(tmp_path / "tok")
    rng = random.Random(1)
    prompts, completions = [], []
    for _ in range(160):
        seq = [f"w{rng.randrange(12)}" for _ in range(6)]
        prompts.append("<s> " + " ".join(seq))
        completions.append(" ".join(seq) + " </s>")
    write_tokenized(tokenize_pairs(prompts, completions, tok, 32), tmp_path / "data.parquet")
    train = TrainConfig(num_workers=2, micro_batch_size=8, epochs=10, max_steps=20, log_every=5,
                        checkpoint_every=20, warmup_steps=2, lr=3e-3)
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=64)
    extra = {"mask_id": tok.mask_token_id, "pad_id": tok.pad_token_id,
             "diffusion": DiffusionConfig(block_size=4, max_steps_per_block=2, loss_weighting="none").model_dump()}
    job = StageJob(stage="cft-test", loss="cft", train=train.model_dump(), model=model.model_dump(),
                   tokenizer_dir=str(tmp_path / "tok"), data_path=str(tmp_path / "data.parquet"),
                   storage_dir=str(tmp_path / "ray"), extra=extra)
    result = run_stage(job)
    losses = [row["train/loss"] for row in result.metrics["history"]]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] * 0.9, losses
