"""Our own llama family (`models/`): llama3-tiny, llama3-debug, llama3-8b, llama3-70b."""

from __future__ import annotations

from autoshard.workloads.base import Workload, full_state, token_batches, token_inputs

ORDER = 0  # asked first: plain model names


def names() -> list[str]:
    from models import CONFIGS

    return list(CONFIGS)


def resolve(name: str, seq: int) -> Workload | None:
    """The workload of model config `name`, its rope tables long enough for `seq`; None when
    `name` is not one of ours."""
    from models import CONFIGS, build_model, cross_entropy_loss

    cfg = CONFIGS.get(name)
    if cfg is None:
        return None
    if seq > cfg.max_seq_len:  # rope tables long enough for the asked sequence
        cfg = cfg.with_(max_seq_len=seq)
    return Workload(
        name=name,
        build=lambda device: build_model(cfg, device=device),
        example_inputs=token_inputs,
        loss_fn=cross_entropy_loss,
        data=lambda seed: token_batches(cfg.vocab_size, seed),
        initial_state=lambda seed: full_state(build_model(cfg, device="cpu", seed=seed)),
    )
