"""A teacher that samples traces from a local causal LM (e.g. a stronger re-ranker checkpoint).

Why keep only parser-accepted samples: SFT data must be grammatical, so each sampled
completion goes through the same strict parser the evaluation uses
(:func:`dgr2.eval.parse.parse_completion`) and only complete, duplicate-free rankings become
traces.  Nothing is downloaded: the model and tokenizer directories are read with
``local_files_only=True``.  Sampling draws its seed from the caller's numpy Generator inside
a forked torch RNG, so results are reproducible and the global torch RNG is left untouched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dgr2.eval.parse import parse_completion
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.tokenizer.hf import load_tokenizer
from dgr2.traces import format as fmt
from dgr2.traces.teacher import RerankRequest, Trace


class HFTeacher:
    """Samples ``<think> ... </answer> </s>`` completions for a request's prompt."""

    name = "hf"

    def __init__(
        self,
        path: str | Path,
        catalog: ItemCatalog,
        tokenizer_path: str | Path | None = None,
        max_new_tokens: int = 192,
        temperature: float = 1.0,
        device: str = "cpu",
    ):
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"teacher model dir {path} has no config.json (a local HF model dir)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (sampling), got {temperature}")
        self.catalog = catalog
        self.tokenizer = load_tokenizer(tokenizer_path if tokenizer_path is not None else path)
        self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
        vocab = self.model.get_input_embeddings().num_embeddings
        if vocab < len(self.tokenizer):
            raise ValueError(f"model vocabulary {vocab} is smaller than the tokenizer's {len(self.tokenizer)}")
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.device = device

    def completions(self, request: RerankRequest, num_samples: int, seed: int) -> list[str]:
        """Raw sampled completion texts, each cut after its first ``</s>``."""
        prompt = self.catalog.prompt(request.history, request.candidates)
        encoded = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(
                **encoded,
                do_sample=True,
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.max_new_tokens,
                num_return_sequences=num_samples,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        prompt_len = encoded["input_ids"].shape[1]
        texts = []
        for row in out[:, prompt_len:].tolist():
            tokens = self.tokenizer.convert_ids_to_tokens(row)
            if fmt.EOS in tokens:
                tokens = tokens[: tokens.index(fmt.EOS) + 1]
            texts.append(" ".join(tokens))
        return texts

    def propose(self, request: RerankRequest, num_samples: int, rng: np.random.Generator) -> list[Trace]:
        """The parser-valid ones among ``num_samples`` sampled completions (possibly none)."""
        if num_samples < 1:
            return []
        seed = int(rng.integers(0, 2**31 - 1))
        traces = []
        for text in self.completions(request, num_samples, seed):
            parsed = parse_completion(text, len(request.candidates))
            if parsed.valid:
                traces.append(Trace(think_tokens=parsed.think.split(), ranking=list(parsed.ranking)))
        return traces
