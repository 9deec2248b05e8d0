"""`eagle-hf train`: make an EAGLE-3.1 (or EAGLE-3) drafter for any HF causal LM."""

from __future__ import annotations

import argparse


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="train a drafter: regenerate data with the target, then TTT training")
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hub id / folder")
    p.add_argument("--prompts", default="sharegpt", help="'sharegpt', a JSON/JSONL file with turns/conversations/messages")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (default: all)")
    p.add_argument("--responses", default=None, help="JSONL of answers produced elsewhere (prompt/response pairs)")
    p.add_argument("--out", required=True, help="output folder (resumes when it holds the same run)")
    p.add_argument("--data-dir", default=None, help="regenerated data (default <out>/data); reused when present")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="tokens in the drafter's lm_head (most frequent in the answers)")
    p.add_argument("--eagle3", action="store_true", help="train an EAGLE-3 drafter (fc_norm and norm_output off)")
    p.add_argument("--batch-size", type=int, default=64, help="generation batch size")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest regenerated answer")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip prompts longer than this (chat-template tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (0 = greedy)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test steps unrolled per row (weights 0.8^k)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the data")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (default: the epochs' steps)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop training (resumably) after this long")
    p.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate (warm-up, then cosine)")
    p.add_argument("--tokens-per-batch", type=int, default=2048, help="padded tokens per optimizer step")
    p.add_argument("--seed", type=int, default=0, help="random seed (prompt order, init, batches)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the target's dtype (regeneration and capture)")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    import torch

    from ..default import load_target
    from .pipeline import RunConfig, run_training
    from .trainer import TrainConfig

    tcfg = TrainConfig(
        ttt_steps=args.ttt_steps, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        tokens_per_batch=args.tokens_per_batch, seed=args.seed, max_minutes=args.max_minutes,
    )
    run = RunConfig(
        prompts=args.prompts, num_prompts=args.num_prompts, data_dir=args.data_dir,
        draft_vocab_size=args.draft_vocab_size, eagle31=not args.eagle3, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature, seed=args.seed, responses=args.responses, train=tcfg,
    )
    target, tok = load_target(args.target, dtype=getattr(torch, args.dtype))
    run_training(target, tok, args.out, run)
    print(f"Saved {'EAGLE-3' if args.eagle3 else 'EAGLE-3.1'} drafter to {args.out}")
    return 0
