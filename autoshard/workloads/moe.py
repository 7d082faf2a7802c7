"""Our mixture-of-experts family (`models/moe.py`): moe-tiny, moe-debug, and Qwen3-MoE's shapes
qwen3-30b-a3b and qwen3-235b-a22b. The step's loss is the cross-entropy plus the weighted
load-balancing loss (`moe_loss`). No Hugging Face form yet: `export --hf` refuses it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from autoshard.workloads.base import Workload, full_state, meta_values, sized_config, token_batches, token_inputs

ORDER = 1  # after our llama names; plain model names


def names() -> list[str]:
    from autoshard_models import MOE_CONFIGS

    return list(MOE_CONFIGS)


def resolve(name: str, seq: int) -> Workload | None:
    """The workload of MoE config `name`, its rope tables long enough for `seq`; None when `name`
    is not one of ours."""
    from autoshard_models import MOE_CONFIGS

    cfg = sized_config(MOE_CONFIGS, name, seq)
    return None if cfg is None else _workload(name, cfg)


def _workload(name: str, cfg: Any) -> Workload:
    from autoshard_models import build_moe_model, moe_loss

    return Workload(
        name=name,
        build=lambda device: build_moe_model(cfg, device=device),
        example_inputs=token_inputs,
        loss_fn=partial(moe_loss, aux_loss_coef=cfg.aux_loss_coef),
        data=lambda seed: token_batches(cfg.vocab_size, seed),
        initial_state=lambda seed: full_state(build_moe_model(cfg, device="cpu", seed=seed)),
        initial_values=lambda seed, want=None: meta_values(build_moe_model(cfg, device="meta"), seed, want),
        vocab_size=cfg.vocab_size,
        resize_vocab=lambda n: _workload(name, cfg.with_(vocab_size=n)),
    )
