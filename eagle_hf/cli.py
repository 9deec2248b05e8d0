"""`eagle-hf`: EAGLE-3 / EAGLE-3.1 speculative decoding in transformers' generate(): generate, bench, demo, train, diagnose."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _target(args):
    from .devices import load_options
    from .drafter.default import load_target

    return load_target(args.target, **load_options(args))


def _check_target_options(args) -> str | None:
    """The error of a bad --device / --device-map / --dtype / --attn-implementation, before anything loads."""
    from .devices import check_load_options, load_options
    from .errors import EagleCompatibilityError

    try:
        check_load_options(**load_options(args))
    except EagleCompatibilityError as err:
        return str(err)
    return None


def cmd_generate(args) -> int:
    import torch

    from . import last_stats
    from .devices import input_device
    from .drafter.default import load_drafter

    target, tok = _target(args)
    drafter, label = load_drafter(args.drafter, target)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    enc = {k: v.to(input_device(target)) for k, v in enc.items()}  # input_ids, attention_mask: [1, P]
    sample = args.temperature > 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=sample, num_assistant_tokens=args.num_draft_tokens,
                  draft_sources=args.draft_sources)
    if sample:
        kwargs["temperature"] = args.temperature
        torch.manual_seed(args.seed)
    from transformers import TextStreamer

    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)  # prints the text as it is produced
    target.generate(**enc, assistant_model=drafter, streamer=streamer, **kwargs)
    print(f"\n[drafter: {label}]")
    print(f"[{last_stats().summary()}]")
    return 0


def cmd_bench(args) -> int:
    from .drafter.default import load_drafter
    from .tools.bench import custom_mode, parse_mode, results_markdown, run_benchmark, standard_modes, write_results

    try:
        own = [parse_mode(spec) for spec in args.mode]  # a bad one fails before any model loads
    except ValueError as e:
        print(f"eagle-hf bench: {e}", file=sys.stderr)
        return 2
    target, tok = _target(args)
    drafter, label = load_drafter(args.drafter, target)
    assistant = None
    if args.assistant:
        from transformers import AutoModelForCausalLM

        from .devices import input_device

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=target.dtype,
                                                         device_map=input_device(target)).eval()
    modes = standard_modes(drafter, assistant, tuple(args.chain_lengths), args.early_exit_layer)
    if args.modes:
        keep = set(args.modes.split(","))
        modes = [m for m in modes if m.name in keep or m.name == "plain"]
    modes += [custom_mode(name, kwargs, drafter) for name, kwargs in own]
    if args.batch_size > 1:  # transformers' assisted modes decode one sequence
        single = [m.name for m in modes if m.name != "plain" and not m.uses_drafter]
        if single:
            print(f"note: {', '.join(single)} cannot run batched in transformers; left out at --batch-size {args.batch_size}")
        modes = [m for m in modes if m.name == "plain" or m.uses_drafter]
    results = run_benchmark(
        target, tok, modes, args.prompts.split(","), args.max_new_tokens, args.limit, args.temperature, args.repeats,
        batch_size=args.batch_size,
    )
    results["drafter"] = label
    out = write_results(results, args.out)
    print(results_markdown(results))
    print(f"[drafter: {label}] results written to {out}/results.json, results.md, speedup.png")
    bad = {s: {m: e["mismatches"] for m, e in modes_.items() if e["mismatches"]} for s, modes_ in results["sets"].items()}
    bad = {s: v for s, v in bad.items() if v}
    if bad and args.temperature == 0:
        if results["machine"]["dtype"] == "torch.float32":
            print(f"ERROR: outputs differ from plain generate() in float32: {bad}")
            return 1
        print(f"note: outputs that differ from plain generate() in {results['machine']['dtype']} (near-tie flips of "
              f"multi-token forwards in reduced precision, as with transformers' own assisted decoding; rerun with "
              f"--dtype float32 to check exactness): {bad}")
    return 0


def cmd_diagnose(args) -> int:
    from .drafter.default import load_drafter
    from .tools.diagnose import DiagnoseError, DiagnoseSettings, diagnose

    try:  # bad settings fail here, before the models load
        settings = DiagnoseSettings(
            prompts=args.prompts, limit=args.limit, conditions=args.conditions, depth=args.depth,
            max_new_tokens=args.max_new_tokens, sink_tokens=args.sink_tokens,
            long_context_tokens=args.long_context_tokens, system_mode=args.system_prompts,
        ).validate()
    except DiagnoseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target, tok = _target(args)
    drafter, label = load_drafter(args.drafter, target)
    if not args.compare:
        report = diagnose(target, tok, drafter, settings, drafter_label=label)
        out = report.save(args.out)
        print(report.markdown())
        print(f"[drafter: {label}] {report.meta['wall_s']:.0f} s; written to {out}/drift.json, drift.md and one PNG "
              "per quantity")
        return 0
    from .tools.diagnose import diagnose_drafters
    from .tools.drift_comparison import compare_markdown, save_comparison

    drafters = {f"{drafter.config.version} ({label})": drafter}
    for name in args.compare:
        other, other_label = load_drafter(name, target)
        other_label = f"{other.config.version} ({other_label})"
        while other_label in drafters:
            other_label += "'"
        drafters[other_label] = other
    reports = diagnose_drafters(target, tok, drafters, settings)
    for i, (name, report) in enumerate(reports.items()):
        report.save(Path(args.out) / f"drafter_{i}")
        print(f"drafter_{i}: {name}")
        print(report.markdown())
    datas = {name: r.to_dict() for name, r in reports.items()}
    out = save_comparison(datas, args.out)
    print(compare_markdown(datas))
    wall = next(iter(reports.values())).meta["wall_s"]
    print(f"{wall:.0f} s; written to {out}: compare.md, compare.json, comparison.png, and each drafter's report in "
          "drafter_<i>/")
    return 0


def cmd_demo(args) -> int:
    import runpy

    app = Path(__file__).resolve().parents[1] / "demo" / "app.py"
    if not app.is_file():
        print("The demo lives in the repository's demo/ folder; run it from a clone: python demo/app.py", file=sys.stderr)
        return 2
    sys.argv = [str(app), *args.demo_args]
    runpy.run_path(str(app), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .devices import add_device_arguments
    from .tools.bench import MODE_NAMES

    parser = argparse.ArgumentParser(prog="eagle-hf", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    g = sub.add_parser("generate", formatter_class=fmt,
                       help="generate with EAGLE drafting, streaming the text, then print the acceptance stats")
    g.add_argument("--prompt", default="Write a short poem about speculative decoding.", help="the user message")
    g.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct, offline) or a Hub id / folder")
    g.add_argument("--drafter", default="default", help="'default' (the shipped drafter), 'random', a folder or a Hub id")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="a fixed chain length (transformers' num_assistant_tokens); default: the adaptive schedule")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling at this temperature")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    g.add_argument("--draft-sources", default="auto", choices=["auto", "eagle", "copy", "eagle+copy"],
                   help="who drafts: the drafter, copies from the prompt and output, or both (auto: both in tree mode)")
    add_device_arguments(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", formatter_class=fmt,
                       help="speed and exactness against plain generate() and transformers' methods")
    b.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct, offline) or a Hub id / folder")
    b.add_argument("--drafter", default="default", help="'default' (the shipped drafter), 'random', a folder or a Hub id")
    b.add_argument("--assistant", default=None, help="a small draft model for transformers' assisted generation")
    b.add_argument("--early-exit-layer", type=int, default=None, help="enable transformers' early-exit mode at this layer")
    b.add_argument("--prompts", default="mt_bench,humaneval,gsm8k,sum,qa,code_edit,multi_turn",
                   help="comma-separated prompt sets (shipped: mt_bench, humaneval, gsm8k, sum, qa, the copy-heavy "
                        "code_edit, multi_turn, and one per kind of text: translation, questions, math_word, rag, "
                        "extraction) or JSONL files")
    b.add_argument("--modes", default=None,
                   help=f"comma-separated subset of modes (plain always runs); one of: {', '.join(MODE_NAMES)}")
    b.add_argument("--mode", action="append", default=[], metavar="NAME=JSON",
                   help="a mode of your own, repeatable: generate() keywords as JSON, e.g. 'copy b1={\"draft_sources\": "
                        "\"copy\", \"copy_branches\": 1}' (with the drafter unless draft_sources is \"copy\")")
    b.add_argument("--chain-lengths", type=int, nargs="+", default=[3, 5], help="fixed chain lengths K to run")
    b.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per prompt")
    b.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    b.add_argument("--repeats", type=int, default=1, help="repeats per prompt (medians are taken)")
    b.add_argument("--batch-size", type=int, default=1,
                   help="prompts per generate() call, left-padded (speed: generated tokens per second per batch)")
    b.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs are compared); above 0: sampling")
    add_device_arguments(b)
    b.add_argument("--out", default="bench_results", help="folder for results.json, results.md and speedup.png")
    b.set_defaults(func=cmd_bench)

    x = sub.add_parser("diagnose", formatter_class=fmt,
                       help="attention drift per draft depth: acceptance, attention on sink/context/drafts, norms")
    x.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct, offline) or a Hub id / folder")
    x.add_argument("--drafter", default="default", help="'default' (the shipped drafter), 'random', a folder or a Hub id")
    x.add_argument("--prompts", default="mt_bench", help="a shipped prompt set (mt_bench, humaneval, gsm8k, sum, qa) or a JSONL file")
    x.add_argument("--limit", type=int, default=8, help="prompts taken from the set")
    x.add_argument("--conditions", default="clean,system,long", help="comma-separated subset of: clean, system, long")
    x.add_argument("--depth", type=int, default=5, help="chain length drafted every round (1 to 16)")
    x.add_argument("--max-new-tokens", type=int, default=64, help="the target's greedy continuation per prompt and condition")
    x.add_argument("--sink-tokens", type=int, default=4, help="the first positions counted as the attention sink")
    x.add_argument("--long-context-tokens", type=int, default=2048, help="unrelated news text before the question (long)")
    x.add_argument("--system-prompts", default="cycle", choices=["cycle", "all"],
                   help="cycle: one of the six system prompts per prompt in turn; all: every prompt under all six")
    add_device_arguments(x)
    x.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default); 1 is much faster on a CPU shared with other jobs")
    x.add_argument("--compare", action="append", default=[], metavar="DRAFTER",
                   help="another drafter (repeatable) replayed over the same target paths: a paired comparison with "
                        "--drafter (e.g. a matched EAGLE-3 drafter), written as compare.md and comparison.png")
    x.add_argument("--out", default="drift_results", help="folder for drift.json, drift.md and the PNGs")
    x.set_defaults(func=cmd_diagnose)

    d = sub.add_parser("demo", help="the Gradio demo (demo/app.py); extra arguments are passed on")
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments for demo/app.py (see its --help)")
    d.set_defaults(func=cmd_demo)

    from .training.cli import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "device_map"):  # a command that loads a target: bad device options fail before any loading
        error = _check_target_options(args)
        if error:
            print(f"eagle-hf {args.command}: {error}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
