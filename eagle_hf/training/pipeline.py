"""`eagle-hf train` end to end: prompts -> regenerated data with hidden states -> draft vocab -> TTT -> save.

Every stage is resumable: data shards are skipped when present, training resumes from ``train_state.pt``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..capture import default_aux_layer_ids, num_decoder_layers, resolve_aux_layer_ids
from ..hf.models import final_norm_scale
from ..modeling import EagleDrafter
from .data import build_dataset, build_dataset_from_responses, load_shards, read_responses
from .prompts import load_prompts
from .trainer import TrainConfig, initialise_from_target, train
from .vocab import build_draft_vocab, count_tokens

logger = logging.getLogger(__name__)

RUN_FILE = "train_run.json"


@dataclass
class RunConfig:
    prompts: str = "sharegpt"
    num_prompts: int | None = None
    data_dir: str | None = None  # default: <out>/data
    draft_vocab_size: int = 8192
    eagle31: bool = True  # fc_norm + norm_output; False trains an EAGLE-3 drafter (same code path)
    aux_layer_ids: list[int] | None = None
    batch_size: int = 64
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    responses: str | None = None  # JSONL of answers produced elsewhere: skip regeneration
    train: TrainConfig = field(default_factory=TrainConfig)


def check_output_dir(out: Path, run: RunConfig) -> None:
    """Refuse an output folder that already holds a different drafter or run, before any compute."""
    run_file = out / RUN_FILE
    if run_file.exists():
        old = json.loads(run_file.read_text())
        new = json.loads(json.dumps(asdict(run)))
        keep = ("draft_vocab_size", "eagle31", "aux_layer_ids", "prompts")
        diff = {k: (old.get(k), new.get(k)) for k in keep if old.get(k) != new.get(k)}
        if diff:
            raise ValueError(f"{out} holds a training run with other settings {diff}; pick a new --out folder.")
    elif (out / "config.json").exists():
        raise ValueError(f"{out} already holds a drafter that this run did not make; pick a new --out folder.")


def run_training(target, tokenizer, out_dir: str | Path, run: RunConfig, prompts_source=None) -> EagleDrafter:
    out = Path(out_dir)
    check_output_dir(out, run)
    if not 0 < run.draft_vocab_size <= target.config.get_text_config().vocab_size:
        raise ValueError(
            f"draft_vocab_size={run.draft_vocab_size} must be between 1 and the target vocabulary size "
            f"({target.config.get_text_config().vocab_size}); 8192-32000 is typical."
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The target tokenizer has no chat template; set `tokenizer.chat_template` first.")
    n_layers = num_decoder_layers(target)
    aux_ids = resolve_aux_layer_ids(run.aux_layer_ids, n_layers) if run.aux_layer_ids else default_aux_layer_ids(n_layers)
    data_dir = Path(run.data_dir) if run.data_dir else out / "data"
    from accelerate import PartialState

    dist = PartialState()
    with dist.main_process_first():  # under `accelerate launch` only the main process writes the data
        _make_data(target, tokenizer, out, run, data_dir, aux_ids, prompts_source)
    drafter, samples, vocab, head = prepare_drafter_for_training(target, data_dir, run, aux_ids)
    result = train(drafter, samples, vocab, head, out, run.train, device=target.device)
    if dist.is_main_process:
        finalize(drafter, target, out, result, vocab)
    return drafter


def _make_data(target, tokenizer, out, run, data_dir, aux_ids, prompts_source) -> None:
    if run.responses:
        pairs = read_responses(run.responses)[: run.num_prompts]
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_FILE).write_text(json.dumps(asdict(run), indent=2))
        build_dataset_from_responses(target, tokenizer, pairs, data_dir, aux_ids)
    else:
        prompts = load_prompts(prompts_source if prompts_source is not None else run.prompts, limit=run.num_prompts, seed=run.seed)
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_FILE).write_text(json.dumps(asdict(run), indent=2))
        build_dataset(
            target, tokenizer, prompts, data_dir, aux_ids, run.batch_size, run.max_new_tokens,
            run.max_prompt_tokens, run.temperature, run.seed,
        )


def prepare_drafter_for_training(target, data_dir, run: RunConfig, aux_ids):
    samples = load_shards(data_dir)
    vocab_size = target.config.get_text_config().vocab_size
    vocab = build_draft_vocab(count_tokens(samples, vocab_size), run.draft_vocab_size)
    default_ids = default_aux_layer_ids(num_decoder_layers(target))
    drafter = EagleDrafter.for_target(
        target,
        draft_vocab_size=run.draft_vocab_size,
        eagle31=run.eagle31,
        aux_layer_ids=None if list(aux_ids) == default_ids else list(aux_ids),
    ).float()
    if drafter.d2t is not None:
        drafter.d2t.copy_(vocab.d2t)
        drafter.t2d.copy_(vocab.t2d)
    target.requires_grad_(False)  # the target is frozen: its embedding must not collect gradients
    drafter.bind_target_embedding(target.get_input_embeddings())
    head = target.get_output_embeddings().weight[vocab.target_ids].detach().float()
    final_norm = final_norm_scale(target)
    torch.manual_seed(run.seed)
    initialise_from_target(drafter, samples, vocab, head, final_norm)
    drafter.config.draft_vocab_coverage = vocab.coverage
    return drafter, samples, vocab, head


def finalize(drafter: EagleDrafter, target, out: Path, result: dict, vocab) -> None:
    """Save the drafter (bf16, EAGLE-3 layout), the curve and the model card."""
    from .report import plot_curve, write_model_card

    target_name = getattr(target, "name_or_path", None) or target.config.name_or_path
    dtype = target.get_input_embeddings().weight.dtype
    drafter.to(dtype).save_pretrained(out, target_model=target_name)
    plot_curve(out)
    write_model_card(out, target_name, drafter.config, result, vocab.coverage)
