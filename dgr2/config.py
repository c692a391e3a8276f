"""One typed config tree for every stage, loaded from YAML profiles.

Why one tree: every stage (data prep, SFT, CFT, OPD, RL, eval, serve) reads the same
object, so a run is fully described by one resolved YAML file that is logged to MLflow
and hashed for stage caching.  Profiles live in ``dgr2/configs/<name>.yaml``; a profile
may ``extends:`` another one and only states what differs.  Command-line overrides use
dotted keys (``sft.num_workers=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROFILE_DIR = Path(__file__).parent / "configs"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Environment overrides matter under `ray job submit --working-dir`, where PROJECT_ROOT is a
# temporary copy of the repository: data must be read from, and runs written to, stable places.
DEFAULT_DATA_DIR = Path(os.environ.get("DGR2_DATA_DIR", PROJECT_ROOT.parent / "shared" / "data" / "amazon_beauty"))
DEFAULT_RUNS_DIR = Path(os.environ.get("DGR2_RUNS_DIR", PROJECT_ROOT / "runs"))


class _Strict(BaseModel):
    """Base: unknown keys are errors, so a typo in a YAML profile never passes silently."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    """Where the interaction files are and how examples are cut from them."""

    path: Path = DEFAULT_DATA_DIR
    max_history: int = Field(20, ge=1, le=200)
    num_candidates: int = Field(10, ge=5, le=50)
    # "always": the target is put in every candidate list (kept at its retriever rank when
    # recalled, otherwise at a seeded random position) - the common re-ranking protocol.
    # "recalled_only": only examples whose retriever list already holds the target are kept.
    target_insertion: Literal["always", "recalled_only"] = "always"
    train_targets_per_user: int = Field(1, ge=1, le=50)
    max_users: int | None = Field(None, ge=1)
    max_eval_examples: int | None = Field(None, ge=1)
    seed: int = 0


class SidConfig(_Strict):
    """Semantic IDs: how many keyword levels form an item's code (plus a collision code)."""

    levels: int = Field(3, ge=1, le=7)


class TraceConfig(_Strict):
    """Reasoning-trace teacher and rejection sampling."""

    teacher: Literal["rule", "hf"] = "rule"
    hf_teacher_path: str | None = None
    accept_top_k: int = Field(3, ge=1)
    samples_per_example: int = Field(4, ge=1, le=64)
    weight_noise: float = Field(0.5, ge=0.0)
    # rule teacher: evidence counts are capped here; 1 makes them presence flags, which a
    # small student copies reliably (see dgr2.traces.evidence)
    max_count: int = Field(9, ge=1, le=9)
    seed: int = 0


class ModelConfig(_Strict):
    """AR backbone: a tiny transformers model from config, or a local checkpoint by path."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    pretrained_path: str | None = None
    hidden_size: int = Field(192, ge=16)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(512, ge=16)
    max_position_embeddings: int = Field(512, ge=64)
    tie_word_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}")
        return self


class TrainConfig(_Strict):
    """One training stage under Ray Train + DeepSpeed ZeRO (shared by SFT, CFT, OPD, RL)."""

    num_workers: int = Field(2, ge=1)
    use_gpu: bool = False
    zero_stage: Literal[1, 2, 3] = 2
    bf16: bool = False
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    micro_batch_size: int = Field(16, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    grad_clip: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(200, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)
    max_failures: int = Field(2, ge=0)
    cpus_per_worker: float = Field(1.0, gt=0)  # Ray resources of one train worker (CPU runs)
    seed: int = 0


class EvalConfig(_Strict):
    """Decoding-based evaluation on the validation and test sets."""

    batch_size: int = Field(64, ge=1)
    max_new_tokens: int = Field(224, ge=8)
    splits: list[Literal["valid", "test"]] = ["valid", "test"]
    # decoding thresholds tau swept for the final diffusion model (the speed/accuracy curve)
    tau_sweep: list[float] = [1.0, 0.9, 0.7, 0.5]
    tau_sweep_split: Literal["valid", "test"] = "test"
    # commit orders swept with each tau (dgr2.decoding.commit); empty = diffusion.commit_order only
    commit_order_sweep: list[Literal["confidence", "left_to_right"]] = []
    # the sweep also times this many prompts decoded one request at a time (batch 1, the
    # latency-bound serving regime), every row's decoder in turn on each prompt
    # (dgr2.eval.latency); 0 skips it
    latency_examples: int = Field(32, ge=0)
    # decode block sizes swept beside tau, at diffusion.confidence_threshold/commit_order: a
    # block decoded in smaller pieces than it was trained in.  Why: a batched pass costs in
    # proportion to the block it recomputes, while the left-to-right rule commits a short run
    # from the left whatever the block, so on compute-bound hardware a smaller decode block buys
    # tokens/s (beauty RL model, batch 64: block 8 at 2.4-2.9x block 32's tokens/s, -0.005 NDCG@10)
    decode_block_sweep: list[Annotated[int, Field(ge=1)]] = []


class DiffusionConfig(_Strict):
    """Block-diffusion conversion and decoding settings (paper: block 32, threshold rule)."""

    block_size: int = Field(32, ge=1, le=64)
    max_steps_per_block: int = Field(8, ge=1)
    confidence_threshold: float = Field(0.9, gt=0.0, le=1.0)
    # which slots a step may commit (dgr2.decoding.commit): "confidence" = the paper's rule
    # (confident slots anywhere), "left_to_right" = the confident run from the leftmost masked slot
    commit_order: Literal["confidence", "left_to_right"] = "confidence"
    # a masked slot whose proposal repeats its still-masked left neighbour's is not confident
    # this step (dgr2.decoding.commit); measured on the beauty CFT model at tau 0.9: 69.0% -> 82.3%
    # valid rankings, NDCG@10 0.612 -> 0.631, tokens a pass 2.38 -> 2.24
    defer_repeats: bool = False
    # greedy left-to-right steps run the LM head on this many leftmost live slots at a time and
    # stop once every row's committed run has ended (dgr2.decoding.block_loop.step_commits); 0 =
    # every slot at once.  Outputs are identical at any value; it only skips head rows the rule
    # would discard.  On CPU, where the head's rows are arithmetic, 8 saves most of them; on an
    # accelerator each chunk is a host sync, so 0 (or the block size) may be faster there
    head_chunk: int = Field(8, ge=0)
    # commit threshold of the ranking sections: from the trace's `ranking_marker` token on (the
    # `order` keyword: the order and answer sections, a permutation that one wrong label makes
    # invalid) a slot commits in parallel only at this confidence (dgr2.decoding.commit, "strict
    # sections"); None = confidence_threshold everywhere (the paper's single threshold).  Applied
    # as max(ranking_threshold, tau), so a tau swept above it decodes every section at that tau.
    # A decode-time rule: the report's rows and the served bundle use it; training rollouts and
    # the stages' own evaluations do not, so setting it re-runs no training stage
    ranking_threshold: float | None = Field(None, gt=0.0, le=1.0)
    ranking_marker: str = "order"
    mask_schedule: Literal["uniform", "linear", "cosine"] = "uniform"
    # Smallest mask ratio a training block can draw (t ~ schedule over [mask_eps, 1]).
    mask_eps: float = Field(1e-3, gt=0.0, lt=1.0)
    # "inverse_t": masked CE weighted by 1/t and averaged over supervised tokens (the
    # masked-diffusion ELBO); "none": plain mean CE over the masked tokens.
    loss_weighting: Literal["inverse_t", "none"] = "inverse_t"
    # share of training blocks that mask their last k tokens instead of a random k-subset: the
    # states a left-to-right decoder visits (dgr2.models.mask_schedule)
    suffix_mask_prob: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _steps_fit_block(self) -> "DiffusionConfig":
        if self.max_steps_per_block > self.block_size:
            raise ValueError(
                f"max_steps_per_block ({self.max_steps_per_block}) > block_size ({self.block_size}): "
                "a step must commit at least one token"
            )
        return self


class CftConfig(TrainConfig):
    """Conversion fine-tuning: masked block-diffusion loss on the teacher trajectories."""

    lr: float = Field(1e-3, gt=0)
    # optimizer steps of the "generic masked-denoising" baseline (same loss on prompt text only)
    generic_steps: int = Field(60, ge=1)
    # extra weight on the masked tokens from the first ``focus_token`` on (the trace's ``order``
    # section and the answer: the permutation one wrong label makes invalid) in the CFT loss,
    # normalised by the summed weights so the loss keeps its scale.  Why: the invalid rankings
    # left after CFT are broken ``order`` sections, ~44 of 200 completion tokens, which an
    # unweighted loss gives a fifth of its gradient (dgr2.train.focus).  1 = off (the paper's loss)
    focus_token: str = Field("order", min_length=1)
    focus_weight: float = Field(1.0, ge=1.0, le=100.0)


class RolloutConfig(_Strict):
    """The Ray actor pool that decodes on-policy trajectories for OPD and RL."""

    num_actors: int = Field(2, ge=1, le=256)
    batch_size: int = Field(16, ge=1)  # prompts per actor call (one decode batch)
    num_cpus_per_actor: float = Field(0.5, gt=0)
    num_gpus_per_actor: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=10.0)  # sampling temperature of rollouts (0 = greedy)
    weight_sync_timeout_s: float = Field(120.0, gt=0)  # a sync slower than this raises, never hangs
    request_timeout_s: float = Field(600.0, gt=0)  # one batch; past it the actor is presumed dead
    # starting one actor (process, imports, model build, first weights); past it the actor is
    # presumed stuck (e.g. no free resources) - kept apart from the two timeouts above so a
    # short request or sync timeout never kills replacements that are still starting
    actor_start_timeout_s: float = Field(300.0, gt=0)
    max_actor_restarts: int = Field(8, ge=0)  # replacements over the pool's life before giving up
    max_new_tokens: int = Field(224, ge=8)


class OpdConfig(TrainConfig):
    """On-policy distillation: student rollouts, dense per-token targets from the AR teacher."""

    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = "reverse_kl"
    jsd_beta: float = Field(0.5, gt=0.0, lt=1.0)  # JSD mixture weight (0.5 = symmetric)
    teacher_top_k: int | None = Field(None, ge=1)  # keep only the teacher's top-k (None = full)
    prompts_per_step: int = Field(16, ge=1)
    rollouts_per_prompt: int = Field(2, ge=1, le=64)
    # which noisy state the student is scored in on its own rollout, and on which slots:
    # "replay" = the state before a recorded decoding step (what its decoder saw), every slot
    # still masked there; "committed" = the same state, only the slots the decoder committed at
    # that step (each token judged where it was decided); "random" = the training mask schedule
    student_mask: Literal["replay", "committed", "random"] = "replay"
    # extra weight on the tokens from the first ``focus_token`` on (the ranking the trace ends
    # with) in the per-token divergence mean.  Why: the invalid rankings left after OPD are copy
    # slips in the last 44 of 200 completion tokens (the ``order`` section and the answer), while
    # an unweighted mean spends 78% of its weight on the evidence lines before them.  1 = off.
    focus_token: str = Field("<answer>", min_length=1)
    focus_weight: float = Field(1.0, ge=1.0, le=100.0)
    # weight of a second term: the same divergence on every completion token with the student
    # read as the causal LM it was converted from (clean left context, no mask slots), i.e. the
    # teacher's own view.  Why: decoded with 1-slot blocks (pure AR use of the weights) the
    # OPD/RL student was 91.7% valid against the AR teacher's 98%, so the copying skill the
    # ranking needs was lost in the weights, not in the masking.  0 = off.
    clean_weight: float = Field(0.0, ge=0.0, le=10.0)


class RlConfig(TrainConfig):
    """GRPO-style RL on the re-ranking reward (one policy-gradient step per rollout batch, so the
    clipped ratio guards against the actor/learner numeric mismatch rather than reuse)."""

    group_size: int = Field(4, ge=2, le=64)
    prompts_per_step: int = Field(8, ge=1)
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)
    clip_eps_high: float = Field(0.28, gt=0.0, lt=1.0)  # DAPO clip-higher
    invalid_reward: float = Field(-1.0, le=0.0)
    echo_alpha: float = Field(0.2, ge=0.0, le=1.0)  # weight of the conditional format term
    # how many of a block's recorded unmasking steps are replayed per update (None = all)
    replay_steps: int | None = Field(None, ge=1)
    # DAPO's dynamic-sampling filter, without the resampling: groups whose rollouts all got the
    # same reward have zero advantage, contribute no gradient, and are left out of the replay
    # (the token mean then runs over the groups that carry signal, as in DAPO).  Measured: with
    # every rollout invalid the replay was 100 s of a 101 s step that changed nothing.
    drop_zero_advantage: bool = True


class ServeModelConfig(_Strict):
    """How the pipeline's final model is published (MLflow registry name)."""

    name: str = Field("dgr2-reranker", pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class TrackingConfig(_Strict):
    """MLflow: local sqlite under the run directory unless a tracking URI is given."""

    tracking_uri: str | None = None  # MLFLOW_TRACKING_URI wins when set
    experiment: str = "dgr2"


# the comparison-only stages ``pipeline.ablations`` can switch on (dgr2.pipeline.OPTIONAL_STAGES)
OptionalStage = Literal["ar_rl", "mdm"]


class PipelineConfig(_Strict):
    """Where runs live (stage caches, run folders, the local MLflow store) and which optional
    comparison stages run.  Which of the other stages run is a command-line choice
    (``--stages`` / ``--from``), not part of the run's identity."""

    runs_dir: Path = DEFAULT_RUNS_DIR
    # rows of the recipe table that are comparisons, not steps of the recipe: ``ar_rl`` (GRPO on
    # the AR model, the GR2 stage) and ``mdm`` (generic masked-denoising conversion).  Each costs
    # a training stage plus an evaluation; the default profile leaves them out.
    ablations: list[OptionalStage] = list(get_args(OptionalStage))


class Config(_Strict):
    """The whole resolved configuration of a pipeline run."""

    profile: str = "default"
    data: DataConfig = DataConfig()
    sid: SidConfig = SidConfig()
    traces: TraceConfig = TraceConfig()
    model: ModelConfig = ModelConfig()
    sft: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    diffusion: DiffusionConfig = DiffusionConfig()
    cft: CftConfig = CftConfig()
    rollout: RolloutConfig = RolloutConfig()
    opd: OpdConfig = OpdConfig()
    rl: RlConfig = RlConfig()
    serve_model: ServeModelConfig = ServeModelConfig()
    tracking: TrackingConfig = TrackingConfig()
    pipeline: PipelineConfig = PipelineConfig()

    @model_validator(mode="after")
    def _decode_blocks_fit(self) -> "Config":
        too_big = [b for b in self.eval.decode_block_sweep if b > self.diffusion.block_size]
        if too_big:
            raise ValueError(
                f"eval.decode_block_sweep {too_big} exceeds diffusion.block_size ({self.diffusion.block_size}): "
                "a decode block larger than the trained block attends across boundaries the model never saw"
            )
        return self

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections: the cache key of a stage's inputs."""
        payload = {name: getattr(self, name).model_dump(mode="json") for name in sections}
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_profile(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in seen:
        raise ValueError(f"config profile cycle: {' -> '.join(map(str, seen + (path,)))}")
    if not path.is_file():
        known = sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"config profile {path} not found (known profiles: {known})")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"config profile {path} must be a mapping, got {type(raw).__name__}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    return _deep_merge(_read_profile(_profile_path(parent, path.parent), seen + (path,)), raw)


def _profile_path(name_or_path: str | Path, relative_to: Path = PROFILE_DIR) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml"):
        return candidate if candidate.is_absolute() or candidate.exists() else relative_to / candidate
    return PROFILE_DIR / f"{name_or_path}.yaml"


def _apply_override(tree: dict[str, Any], dotted: str) -> None:
    if "=" not in dotted:
        raise ValueError(f"override {dotted!r} must look like section.key=value")
    key, text = dotted.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(text)


def load_config(profile: str | Path = "default", overrides: list[str] | None = None) -> Config:
    """Load a profile by name (``tiny``) or path (``my.yaml``) and apply dotted overrides."""
    path = _profile_path(profile)
    tree = _read_profile(path)
    tree.setdefault("profile", path.stem)
    for item in overrides or []:
        _apply_override(tree, item)
    return Config.model_validate(tree)
