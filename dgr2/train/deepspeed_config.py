"""DeepSpeed engine config from the typed TrainConfig (one source of truth for every stage)."""

from __future__ import annotations

from typing import Any

from dgr2.config import TrainConfig


def deepspeed_config(cfg: TrainConfig, total_steps: int) -> dict[str, Any]:
    """ZeRO stage, optimizer and LR schedule for ``deepspeed.initialize``.

    ``torch_adam`` + ``zero_force_ds_cpu_optimizer: false`` use torch's AdamW, so nothing has to
    be compiled on a CPU-only machine (DeepSpeed's fused/CPU Adam need a C++ build); on GPUs the
    same config runs under NCCL.
    """
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_force_ds_cpu_optimizer": False,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": cfg.lr,
                "warmup_num_steps": min(cfg.warmup_steps, max(total_steps - 1, 0)),
                "total_num_steps": max(total_steps, 1),
                "warmup_type": "linear",
            },
        },
        "bf16": {"enabled": cfg.bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
