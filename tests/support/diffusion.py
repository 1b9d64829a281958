"""mlx-vlm's own denoising loop (`stream_diffusion_generate`) on the diffusion built-in: the
reference denoising parity compares to."""

from __future__ import annotations

import importlib

import mlx.core as mx

from tests.support.config import builtin_dir

DIFFUSION_MODEL = "builtin:tiny-diffusion-gemma"
BLOCK_MODEL = "builtin:tiny-llada2"


class _Stops:
    """mlx-vlm's stopping criteria over the given end tokens."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = set(ids)

    def __call__(self, token: int) -> bool:
        return token in self.ids

    def add_eos_token_ids(self, ids) -> None:
        pass  # (the requests compared say which end tokens stop them)


class DiffusionReference:
    """The built-in's model and tokenizer as mlx-vlm loads them, and its denoising loop."""

    def __init__(self, model: str = DIFFUSION_MODEL) -> None:
        from mlx_lm.utils import load_tokenizer
        from mlx_vlm.tokenizer_utils import NaiveStreamingDetokenizer
        from mlx_vlm.utils import load_model

        directory = builtin_dir(model.removeprefix("builtin:"))
        self.model = load_model(directory)
        self.tokenizer = load_tokenizer(directory)
        self._loop = importlib.import_module("mlx_vlm.generate.diffusion")

        class Processor:
            detokenizer = NaiveStreamingDetokenizer(self.tokenizer._tokenizer)

        self._processor = Processor()

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def generate(self, prompt_ids: list[int], max_tokens: int, *, seed: int, temperature: float = 0.0, stop_ids: list[int] = (), **options) -> list[int]:
        """The answer's tokens (an end token in `stop_ids` ends it, not included); the denoising
        steps it took in `last_steps`."""
        tokenizer = self.tokenizer._tokenizer
        tokenizer.stopping_criteria = _Stops(list(stop_ids))
        mx.random.seed(seed)
        results = list(
            self._loop.stream_diffusion_generate(
                self.model,
                self._processor,
                tokenizer,
                mx.array([prompt_ids]),
                None,
                None,
                max_tokens=max_tokens,
                skip_special_token_ids=[],
                temperature=temperature,
                **options,
            )
        )
        self.last_steps = results[-1].diffusion_denoising_steps
        # One result per token; a canvas's end and the last result repeat a token.
        return [r.token for r in results if r.finish_reason is None and not r.diffusion_block_complete and not r.is_draft]

    def generate_blocks(
        self, prompt_ids: list[int], max_tokens: int, *, seed: int, temperature: float = 0.0, steps: int | None = None, threshold: float | None = None
    ) -> list[int]:
        """A block-diffusion model's answer (LLaDA2-MoE): its own loop, called as
        `stream_diffusion_generate` calls it for a model-driven family (whose results carry a
        block's text, not its tokens): the config's block length and steps, else mlx-vlm's 32 and
        32; `eos_early_stop`. The answer's tokens up to an end token (not included)."""
        mx.random.seed(seed)
        config = self.model.config
        out = self.model.language_model.generate(
            mx.array([prompt_ids]),
            temperature=temperature,
            block_length=getattr(config, "default_block_length", None) or 32,
            steps=steps or getattr(config, "default_diffusion_steps", 32),
            gen_length=max_tokens,
            eos_early_stop=True,
            **({} if threshold is None else {"threshold": threshold}),
        )
        tokens = [int(t) for t in out[0].tolist()]
        eos = config.eos_token_id
        return tokens[:-1] if tokens and tokens[-1] in (eos if isinstance(eos, list) else [eos]) else tokens
