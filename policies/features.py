"""Which of a request's features combine, decided before admission (pure).

Admission renders the prompt and compiles what these rules ask for; the rules themselves live here:
a diffusion model's request takes its denoising options (canvas bounded by the model's) and neither
speculates nor takes a grammar; a distributed world does not speculate; jump-forward applies to a
grammar only where no strict fast-forward rows do the same work and nothing reads sampled tokens'
probabilities; scoring a prompt makes a request bulk work.
"""

from __future__ import annotations

import msgspec

from policies.speculation import plan_speculation
from protocols.api import DenoisingOptions, GenerateRequest, SpecStats
from protocols.config import SpeculativeConfig
from protocols.errors import InvalidRequestError
from protocols.model import FillPlan, GrammarSpec, ModelInfo, SpecPlan


def denoising_options(request: GenerateRequest, info: ModelInfo) -> DenoisingOptions | None:
    """A diffusion model's request: its options, the canvas bounded by the model's (None for
    other models)."""
    if not info.denoising:
        return None
    options = request.denoising or DenoisingOptions()
    if info.denoises_blocks and options.min_canvas_length:
        raise InvalidRequestError(
            f"a block-diffusion model ({info.model_type}) unmasks blocks at fixed positions: min_canvas_length does not apply",
            field="denoising.min_canvas_length",
        )
    return msgspec.structs.replace(options, canvas_length=min(options.canvas_length or info.canvas_length, info.canvas_length))


def speculation(
    request: GenerateRequest, config: SpeculativeConfig, *, denoising: bool, grammar: GrammarSpec | None, distributed: bool
) -> tuple[SpecPlan | None, SpecStats | None]:
    """The request's speculation plan and stats, where its other features allow one. Raises
    `InvalidRequestError` for a grammar on a denoising request."""
    spec_plan, spec_stats = plan_speculation(request, config, has_draft=bool(config.draft))
    if denoising:
        if grammar is not None:
            raise InvalidRequestError("structured output does not apply to a diffusion language model's denoising", field="tools")
        return None, None  # (nothing to speculate: a canvas is denoised whole)
    if spec_plan is not None and spec_stats is not None and distributed:
        return None, msgspec.structs.replace(spec_stats, refused="a distributed world does not speculate")
    return spec_plan, spec_stats


def jump_forward(request: GenerateRequest, grammar: GrammarSpec | None, fill_plan: FillPlan | None, default: bool) -> bool:
    """Whether grammar-forced tokens are appended in one forward. Strict fast-forward rows, where
    a forced tool call has some, take its place; forced tokens are not sampled, so never under
    logprobs or logits controls."""
    if grammar is None or (fill_plan and fill_plan.rows) or request.logprobs or request.top_logprobs or request.sampling.has_logit_controls:
        return False
    return request.jump_forward if request.jump_forward is not None else default


def is_bulk(request: GenerateRequest) -> bool:
    """Background work (`GenerateRequest.bulk`), or a request scoring its prompt."""
    return request.bulk or request.prompt_logprobs is not None
