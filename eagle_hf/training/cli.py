"""`eagle-hf train`: make an EAGLE-3.1 (or EAGLE-3) drafter for any HF causal LM."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_train_parser(sub) -> None:
    from ..devices import add_device_arguments

    p = sub.add_parser("train", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="train a drafter: regenerate data with the target, then TTT training")
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hub id / folder")
    p.add_argument("--prompts", default="sharegpt", help="prompts to regenerate answers to: 'sharegpt', a JSON/JSONL file with turns/conversations/messages")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (with --responses: the first N records of each file; default: all)")
    p.add_argument("--responses", action="append", default=None, metavar="FILE|GLOB|sharegpt-original:N",
                   help="answers to teacher-force instead of regenerating (repeatable): JSONL(.gz) files or globs of "
                        "prompt/response records (a growing .partial chunk of data/regenerated too), or "
                        "sharegpt-original:N / sharegpt-original:A-B for ShareGPT's own answers; each is captured into "
                        "its own folder under --data-root and reused on reruns")
    p.add_argument("--out", required=True, help="output folder (resumes when it holds the same run)")
    p.add_argument("--data-dir", action="append", default=None,
                   help="captured data folder to train on (repeatable); without --responses, a single folder "
                        "without captured shards is where the prompts are regenerated (default <out>/data)")
    p.add_argument("--data-root", default=None, help="where --responses are captured, one folder each (default <out>/captures)")
    p.add_argument("--init-from", default=None, help="warm start from this drafter (folder, Hub id, or 'default' for the shipped one): "
                                                     "keeps its draft vocabulary, aux layers and EAGLE-3.1 flags")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="tokens in the drafter's lm_head, the most frequent in the answers (default 8192, or the --init-from drafter's)")
    p.add_argument("--eagle3", action="store_true", help="train an EAGLE-3 drafter (fc_norm and norm_output off)")
    p.add_argument("--batch-size", type=int, default=64, help="generation batch size")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest regenerated answer")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip prompts longer than this (chat-template tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (0 = greedy)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test steps unrolled per row (weights 0.8^k)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the data")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (default: the epochs' steps)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training (resumably) after this long")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop training (resumably) after this step; the learning-rate schedule still runs to --max-steps")
    p.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (warm-up, then cosine)")
    p.add_argument("--warmup-ratio", type=float, default=0.02, help="share of the steps spent warming up the learning rate")
    p.add_argument("--tokens-per-batch", type=int, default=2048,
                   help="padded tokens per optimizer step, over all processes (torchrun / accelerate launch)")
    p.add_argument("--eval-every", type=int, default=200, help="evaluate on the held-out split every N steps (and keep the best drafter in <out>/best)")
    p.add_argument("--save-every", type=int, default=100, help="write the resumable checkpoint train_state.pt every N steps")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of conversations held out (by prompt)")
    p.add_argument("--eval-tokens", type=int, default=20000, help="held-out answer tokens read by each evaluation")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", default=None,
                   help="train in float32 (default: bf16 autocast where the device computes bf16 natively)")
    p.add_argument("--compile", action="store_true", help="torch.compile the drafter's decoder layer (about 1.3x on this CPU after a minute or two of compiling; needs a C++ compiler)")
    p.add_argument("--feature-noise", type=float, default=0.0, metavar="SCALE",
                   help="uniform noise on the captured target states while training, half-width SCALE x each state's RMS "
                        "(EAGLE's feature augmentation; 0 = off, e.g. 0.1)")
    p.add_argument("--seed", type=int, default=0, help="random seed (prompt order, init, batches)")
    add_device_arguments(p, dtype_help="the target's dtype (regeneration and capture)", dtypes=("bfloat16", "float32"))
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    import torch

    from ..cli_checks import check_target_name, check_temperature
    from ..devices import load_options
    from ..drafter.default import load_target
    from .distributed import local_device
    from .pipeline import RunConfig, run_training, validate_run
    from .trainer import TrainConfig

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out}: a file, not a folder; name the folder for the drafter.")
    check_target_name(args.target)
    check_temperature(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    tcfg = TrainConfig(
        ttt_steps=args.ttt_steps, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        warmup_ratio=args.warmup_ratio, tokens_per_batch=args.tokens_per_batch, seed=args.seed,
        max_minutes=args.max_minutes, eval_every=args.eval_every, save_every=args.save_every,
        eval_fraction=args.eval_fraction, eval_tokens=args.eval_tokens, compile=args.compile,
        feature_noise=args.feature_noise, stop_after=args.stop_after, bf16=args.bf16,
    )
    data_dir = args.data_dir[0] if args.data_dir and len(args.data_dir) == 1 else args.data_dir
    responses = args.responses[0] if args.responses and len(args.responses) == 1 else args.responses
    run = RunConfig(
        prompts=args.prompts, num_prompts=args.num_prompts, data_dir=data_dir, data_root=args.data_root,
        draft_vocab_size=args.draft_vocab_size, eagle31=False if args.eagle3 else None, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature, seed=args.seed, responses=responses, init_from=args.init_from, train=tcfg,
    )
    init = validate_run(run)  # bad files, folders or flags fail here, before the target is loaded
    args.device = local_device(args.device)  # under a launcher: this process's GPU
    target, tok = load_target(args.target, **load_options(args))
    drafter = run_training(target, tok, args.out, run, init=init)
    if torch.distributed.is_initialized():
        main = torch.distributed.get_rank() == 0
        torch.distributed.destroy_process_group()
        if not main:
            return 0
    version = drafter.config.version
    print(f"Saved {version} drafter to {args.out}")
    return 0
