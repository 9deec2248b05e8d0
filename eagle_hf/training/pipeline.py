"""`eagle-hf train` end to end: data (regenerated, captured answers, captured folders) -> draft vocab -> TTT -> save.

Every stage is resumable: data shards are skipped when present (captures of answer files when their records are
unchanged), training resumes from ``train_state.pt``. ``init_from`` warm-starts from an existing drafter (its
draft vocabulary, aux layers and EAGLE-3.1 flags are kept; no ridge init). The drafter with the best held-out
acceptance length (``<out>/best``) becomes the final output.

Under `torchrun` (or `accelerate launch --multi_gpu`) the processes share every stage: each makes its share of the
data shards, computes its slice of every global batch, and the main process writes the outputs (distributed.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..drafter.capture import default_aux_layer_ids, num_decoder_layers, resolve_aux_layer_ids
from ..drafter.modeling import EagleDrafter
from ..files import tensor_bytes, write_file, write_folder
from .data import META_FILE, build_dataset, load_shards
from .distributed import Processes, check_launcher, join_processes
from .prompts import load_prompts
from .sources import AnswerSource, DataFolder, capture_sources, check_folder_fits, describe_folder, parse_answer_specs
from .trainer import BEST_DIR, TrainConfig, initialise_from_target, train
from .vocab import DraftVocab, build_draft_vocab, count_tokens

logger = logging.getLogger(__name__)

RUN_FILE = "train_run.json"
DEFAULT_DRAFT_VOCAB_SIZE = 8192


@dataclass
class RunConfig:
    prompts: str = "sharegpt"
    num_prompts: int | None = None  # first N prompts to regenerate (with `responses`: first N records per file)
    # Captured folders to train on. Without `responses`, a single folder that holds no captured shards (or a
    # regeneration of `prompts`, data_meta.json) is where the prompts are regenerated (default <out>/data).
    data_dir: list[str] | str | None = None
    data_root: str | None = None  # where `responses` are captured, one folder each (default <out>/captures)
    draft_vocab_size: int | None = None  # default 8192, or the init drafter's
    eagle31: bool | None = None  # fc_norm + norm_output (default True, or the init drafter's); False: EAGLE-3
    aux_layer_ids: list[int] | None = None
    batch_size: int = 64
    max_new_tokens: int = 256
    max_prompt_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    responses: list[str] | str | None = None  # answer files / globs / sharegpt-original:N (see sources.py)
    init_from: str | None = None  # warm start: a drafter folder or Hub id, or "default" (the shipped drafter)
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass
class DataPlan:
    answers: list[AnswerSource]
    folders: list[DataFolder]
    regenerate_into: Path | None
    data_root: Path


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, (str, Path)) else [str(v) for v in value]


def _same_file_names(value):
    """A setting that names an existing file or folder, as its absolute path (`./x.jsonl` and `x.jsonl` are one
    file); anything else (a prompt set's name, a Hub id) unchanged."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def run_record(run: RunConfig) -> dict:
    """What ``train_run.json`` holds: the run's settings, its file names as absolute paths."""
    record = json.loads(json.dumps(asdict(run)))
    for key in ("prompts", "init_from"):
        record[key] = _same_file_names(record.get(key))
    return record


def check_output_dir(out: Path, run: RunConfig) -> None:
    """Refuse an output folder that already holds a different drafter or run, before any compute (files compared
    by where they are, not how they are spelt)."""
    run_file = out / RUN_FILE
    if run_file.exists():
        old = json.loads(run_file.read_text())
        new = run_record(run)
        keep = ("draft_vocab_size", "eagle31", "aux_layer_ids", "prompts", "init_from")
        diff = {k: (old.get(k), new.get(k)) for k in keep if _same_file_names(old.get(k)) != new.get(k)}
        if diff:
            raise ValueError(f"{out} holds a training run with other settings {diff}; pick a new --out folder.")
    elif (out / "config.json").exists():
        raise ValueError(f"{out} already holds a drafter that this run did not make; pick a new --out folder.")


def load_init_drafter(name: str) -> EagleDrafter:
    """The drafter to warm-start from, in float32: a folder, a Hub id, or "default" (the shipped drafter)."""
    from ..drafter.checkpoint import DrafterLoadError
    from ..drafter.default import DEFAULT_DRAFTER

    path = DEFAULT_DRAFTER if name == "default" else name
    if name == "default" and not Path(DEFAULT_DRAFTER, "config.json").is_file():
        raise ValueError(f"--init-from default: no drafter is shipped at {DEFAULT_DRAFTER}.")
    looks_local = Path(path).exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1
    if looks_local and not Path(path, "config.json").is_file():
        raise ValueError(f"--init-from {name}: {path} is not a drafter folder (no config.json).")
    try:
        return EagleDrafter.from_pretrained(path, dtype=torch.float32)
    except (OSError, DrafterLoadError) as err:
        raise ValueError(f"--init-from {name}: cannot load this drafter: {err}") from err


def resolve_run(run: RunConfig, init: EagleDrafter | None = None, num_layers: int | None = None) -> RunConfig:
    """Fill the defaults of `draft_vocab_size` and `eagle31`; with a warm start, take the init drafter's and
    refuse explicit values that disagree with it (before any compute)."""
    if init is None:
        return replace(
            run,
            draft_vocab_size=DEFAULT_DRAFT_VOCAB_SIZE if run.draft_vocab_size is None else run.draft_vocab_size,
            eagle31=True if run.eagle31 is None else run.eagle31,
        )
    cfg = init.config
    init31 = bool(cfg.fc_norm and cfg.norm_output)
    conflicts = []
    if run.draft_vocab_size is not None and run.draft_vocab_size != cfg.draft_vocab_size:
        conflicts.append(f"draft vocabulary size {run.draft_vocab_size} asked, the drafter has {cfg.draft_vocab_size}")
    mixed = cfg.fc_norm != cfg.norm_output  # neither EAGLE-3 nor 3.1: kept as it is
    if run.eagle31 is not None and (mixed or run.eagle31 != init31):
        asked = "EAGLE-3.1" if run.eagle31 else "EAGLE-3 (--eagle3)"
        conflicts.append(f"{asked} asked, the drafter has fc_norm={cfg.fc_norm}, norm_output={cfg.norm_output}")
    if run.aux_layer_ids is not None:
        init_ids = cfg.aux_layer_ids
        if num_layers is not None:
            init_ids = resolve_aux_layer_ids(cfg.aux_layer_ids, num_layers)
            asked = resolve_aux_layer_ids(run.aux_layer_ids, num_layers)
        else:
            asked = list(run.aux_layer_ids)
        if init_ids is not None and list(asked) != list(init_ids):
            conflicts.append(f"aux layers {list(run.aux_layer_ids)} asked, the drafter reads {list(init_ids)}")
    if conflicts:
        raise ValueError(
            f"--init-from {run.init_from}: " + "; ".join(conflicts) + ". A warm start keeps the drafter's "
            "settings: drop these flags, or train from scratch without --init-from."
        )
    return replace(run, draft_vocab_size=cfg.draft_vocab_size, eagle31=None if mixed else init31)


def check_settings(run: RunConfig) -> None:
    """Training settings out of range, or a launcher that shards the model (before any compute)."""
    check_launcher()
    noise = run.train.feature_noise
    if not 0 <= noise <= 1:  # also refuses NaN
        raise ValueError(f"--feature-noise {noise}: must be between 0 (off) and 1 (noise as large as the state); "
                         "EAGLE's feature augmentation is about 0.1.")


def validate_run(run: RunConfig) -> EagleDrafter | None:
    """Checks that need no target (files, globs, folders, the init drafter and conflicting flags), to run before
    loading the target; returns the init drafter (pass it to `run_training`)."""
    check_settings(run)
    init = load_init_drafter(run.init_from) if run.init_from else None
    resolve_run(run, init)
    parse_answer_specs(run.responses, limit=run.num_prompts)
    dirs = _as_list(run.data_dir)
    if len(dirs) > 1 or run.responses:
        for d in dirs:
            describe_folder(Path(d))
    return init


def plan_data(run: RunConfig, out: Path) -> DataPlan:
    """Which data this run reads and makes; raises on a missing file or folder before any compute."""
    answers = parse_answer_specs(run.responses, limit=run.num_prompts)
    dirs = [Path(d) for d in _as_list(run.data_dir)]
    regenerate_into = None
    if not answers:
        if not dirs:
            regenerate_into = out / "data"
        elif len(dirs) == 1 and (not any(dirs[0].glob("shard_*.safetensors")) or (dirs[0] / META_FILE).exists()):
            regenerate_into, dirs = dirs[0], []
    folders = [describe_folder(d) for d in dirs]
    data_root = Path(run.data_root) if run.data_root else out / "captures"
    return DataPlan(answers, folders, regenerate_into, data_root)


def run_training(target, tokenizer, out_dir: str | Path, run: RunConfig, prompts_source=None,
                 init: EagleDrafter | None = None) -> EagleDrafter:
    out = Path(out_dir)
    n_layers = num_decoder_layers(target)
    text_cfg = target.config.get_text_config()
    if run.init_from and init is None:
        init = load_init_drafter(run.init_from)
    check_settings(run)
    run = resolve_run(run, init, n_layers)
    check_output_dir(out, run)
    if not 0 < run.draft_vocab_size <= text_cfg.vocab_size:
        raise ValueError(
            f"draft_vocab_size={run.draft_vocab_size} must be between 1 and the target vocabulary size "
            f"({text_cfg.vocab_size}); 8192-32000 is typical."
        )
    if init is not None:
        check_init_fits_target(init, target, run.init_from)
        aux_ids = resolve_aux_layer_ids(init.config.aux_layer_ids, n_layers)
    else:
        aux_ids = resolve_aux_layer_ids(run.aux_layer_ids, n_layers) if run.aux_layer_ids else default_aux_layer_ids(n_layers)
    plan = plan_data(run, out)
    for folder in plan.folders:
        check_folder_fits(folder, aux_ids, text_cfg.hidden_size)
    procs = join_processes(target.device)
    procs.barrier()  # every process has checked the output folder before the main process writes to it
    folders = _make_data(target, tokenizer, out, run, plan, aux_ids, prompts_source, procs)
    drafter, samples, vocab, head, info = prepare_drafter_for_training(target, folders, run, aux_ids, init)
    target_name = getattr(target, "name_or_path", None) or target.config.name_or_path
    result = train(
        drafter, samples, vocab, head, out, run.train, device=target.device,
        target_head=target.get_output_embeddings().weight.detach(), sources=info["sources"], greedy=info["greedy"],
        save_dtype=target.get_input_embeddings().weight.dtype, target_name=target_name,
    )
    if procs.main:
        drafter = finalize(drafter, target, out, result, vocab, info)
    return drafter


def check_init_fits_target(init: EagleDrafter, target, name) -> None:
    text = target.config.get_text_config()
    cfg = init.config
    if cfg.vocab_size != text.vocab_size or cfg.target_hidden_size != text.hidden_size:
        raise ValueError(
            f"--init-from {name}: the drafter was made for a target with vocabulary {cfg.vocab_size} and width "
            f"{cfg.target_hidden_size}; this target has {text.vocab_size} and {text.hidden_size}."
        )


def _make_data(target, tokenizer, out, run, plan: DataPlan, aux_ids, prompts_source,
               procs: Processes | None = None) -> list[DataFolder]:
    """Regenerate and capture what the run reads; with several processes each makes its share of the shards."""
    procs = procs or Processes()
    out.mkdir(parents=True, exist_ok=True)
    if procs.main:
        record = json.dumps(run_record(run), indent=2)
        if not (out / RUN_FILE).is_file() or (out / RUN_FILE).read_text() != record:  # (a resume writes nothing)
            write_file(out / RUN_FILE, record)
    folders = list(plan.folders)
    if plan.regenerate_into is not None:
        prompts = load_prompts(prompts_source if prompts_source is not None else run.prompts, limit=run.num_prompts, seed=run.seed)
        build_dataset(
            target, tokenizer, prompts, plan.regenerate_into, aux_ids, run.batch_size, run.max_new_tokens,
            run.max_prompt_tokens, run.temperature, run.seed, procs=procs,
        )
        folders.insert(0, DataFolder(plan.regenerate_into, greedy=run.temperature == 0, source=str(run.prompts)))
    if plan.answers:
        folders += capture_sources(target, tokenizer, plan.answers, plan.data_root, aux_ids, procs=procs)
    return folders


def prepare_drafter_for_training(target, folders, run: RunConfig, aux_ids, init: EagleDrafter | None = None):
    """Load every folder's samples, then the drafter: the init drafter (its vocabulary) or a fresh one, warm-started
    from the target (lm_head rows, a uniform final norm, ridge-fitted fc)."""
    if isinstance(folders, (str, Path)):
        folders = [DataFolder(Path(folders))]
    samples, sources, greedy = [], [], []
    for folder in folders:
        part = load_shards(folder.path)
        tokens = sum(int(s["loss_mask"].sum()) for s in part)
        logger.info("data %s: %d conversations, %d answer tokens", folder.path, len(part), tokens)
        samples += part
        sources += [folder.name] * len(part)
        greedy += [folder.greedy] * len(part)
    vocab_size = target.config.get_text_config().vocab_size
    counts = count_tokens(samples, vocab_size)
    if init is not None:
        drafter = init.float()
        if drafter.d2t is None:  # the drafter predicts the whole target vocabulary
            d2t, t2d = torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)
        else:
            d2t, t2d = drafter.d2t.detach().long().clone().cpu(), drafter.t2d.detach().bool().clone().cpu()
        total = int(counts.sum())
        vocab = DraftVocab(d2t=d2t, t2d=t2d, coverage=float(counts[t2d].sum()) / total if total else 0.0)
        logger.info("warm start from %s: its draft vocabulary covers %.2f%% of these answer tokens",
                    run.init_from, 100 * vocab.coverage)
    else:
        vocab = build_draft_vocab(counts, run.draft_vocab_size)
        default_ids = default_aux_layer_ids(num_decoder_layers(target))
        torch.manual_seed(run.seed)  # the layer's random start (the same in every process of a data parallel run)
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
    if init is None:
        torch.manual_seed(run.seed)
        initialise_from_target(drafter, samples, vocab, head)
    drafter.config.draft_vocab_coverage = vocab.coverage
    info = {"sources": sources, "greedy": greedy, "folders": [str(f.path) for f in folders],
            "answer_tokens": int(sum(int(s["loss_mask"].sum()) for s in samples)), "conversations": len(samples)}
    return drafter, samples, vocab, head, info


def finalize(drafter: EagleDrafter, target, out: Path, result: dict, vocab, info: dict | None = None) -> EagleDrafter:
    """Save the final drafter (bf16, EAGLE-3 layout): the one with the best held-out acceptance length (``best/``)
    when evaluations ran, else the last weights; then the curve and the model card."""
    from .report import plot_curve, write_model_card

    target_name = getattr(target, "name_or_path", None) or target.config.name_or_path
    dtype = target.get_input_embeddings().weight.dtype
    best = result.get("best")
    best_dir = out / BEST_DIR
    notes = ""
    if best and (best_dir / "model.safetensors").is_file():
        for name in ("config.json", "model.safetensors"):  # (each whole or not at all)
            write_file(out / name, functools.partial(shutil.copyfile, best_dir / name),
                       size=(best_dir / name).stat().st_size)
        device = next(drafter.parameters()).device  # the saved best comes back where training ran
        drafter = EagleDrafter.from_pretrained(out).to(device)
        notes = (
            f"These are the weights of step {best['step']} (of {result.get('step')} trained so far), the highest "
            f"held-out acceptance length of the run's evaluations (τ {best['eval_tau']:.3f}: greedy chain of "
            f"{result.get('config', {}).get('eval_chain', 5)}, TTT-style on held-out conversations; "
            "`training_log.jsonl` has every evaluation)."
        )
    else:  # written beside, then moved in: a full disk leaves no half-written drafter in `out`
        staged = write_folder(out / ".drafter", lambda tmp: drafter.to(dtype).save_pretrained(tmp, target_model=target_name),
                              size=tensor_bytes(drafter.state_dict()))
        for f in staged.iterdir():
            os.replace(f, out / f.name)
        staged.rmdir()
    if info:
        notes += (f"\n\nTraining data: {info['conversations']} conversations, {info['answer_tokens']} answer tokens, "
                  "from " + ", ".join(f"`{f}`" for f in info["folders"]) + ".")
    plot_curve(out)
    write_model_card(out, target_name, drafter.config, {**result, **({"eval_step_accuracy": best.get("eval_step_accuracy")} if best else {})},
                     vocab.coverage, notes=notes)
    return drafter
