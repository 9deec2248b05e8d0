"""`eagle-hf`: EAGLE-3 / EAGLE-3.1 speculative decoding in transformers' generate(): generate, bench, demo, train, diagnose,
serve."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from .cli_checks import check_target_name, check_temperature

#: what a user's flags, files, folders or models cause: one line on stderr and exit status 2 (`-v`: the traceback
#: too); anything else is a bug and keeps its traceback
USER_ERRORS = (ValueError, OSError, ImportError)


def _target(args):
    from .devices import load_options
    from .drafter.default import load_target

    return load_target(args.target, **load_options(args))


def _drafter_before_target(name: str):
    """``(drafter, label)`` for a drafter that loads without its target (a folder, a Hub id, the shipped one),
    loaded before the target so that a missing or bad one fails at once; None for one shaped for the target."""
    from .drafter.default import DEFAULT_DRAFTER, load_drafter

    if name == "random" or (name == "default" and not Path(DEFAULT_DRAFTER, "config.json").is_file()):
        return None
    return load_drafter(name)


def _models(args):
    """The target, its tokenizer and ``(drafter, label)``: the flags and the drafter checked before the target
    loads."""
    from .drafter.default import load_drafter

    check_target_name(args.target)
    early = _drafter_before_target(args.drafter)
    target, tok = _target(args)
    return target, tok, early or load_drafter(args.drafter, target)


def check_counts(args, *names: str, optional: tuple[str, ...] = ()) -> None:
    """Flags that count something: at least 1 (`optional`: or unset)."""
    for name in names + optional:
        value = getattr(args, name)
        if (value is not None or name not in optional) and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be at least 1.")


def _check_target_options(args) -> str | None:
    """The error of a bad --device / --device-map / --dtype / --attn-implementation, before anything loads."""
    from .devices import check_load_options, load_options
    from .errors import EagleCompatibilityError

    try:
        check_load_options(**load_options(args))
    except EagleCompatibilityError as err:
        return str(err)
    return None


def _check_draft_length(args) -> None:
    from .speculation.settings import MAX_DEPTH

    check_counts(args, optional=("num_draft_tokens",))
    if args.num_draft_tokens is not None and args.num_draft_tokens > MAX_DEPTH:
        raise ValueError(f"--num-draft-tokens {args.num_draft_tokens}: must be in 1..{MAX_DEPTH}.")


def cmd_generate(args) -> int:
    import torch

    from . import last_stats
    from .devices import input_device

    check_counts(args, "max_new_tokens")
    _check_draft_length(args)
    check_temperature(args)
    target, tok, (drafter, label) = _models(args)
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
    from .tools.bench import (
        check_mode_names,
        custom_mode,
        parse_mode,
        prepare_out_dir,
        results_markdown,
        run_benchmark,
        standard_modes,
        write_results,
    )
    from .tools.evaluation import load_prompt_set

    # everything the flags name is checked before any model loads
    own = [parse_mode(spec) for spec in args.mode]
    check_counts(args, "max_new_tokens", "repeats", "batch_size", optional=("limit",))
    check_temperature(args)
    keep = [name.strip() for name in args.modes.split(",")] if args.modes else None
    if keep is not None:
        check_mode_names(keep, tuple(args.chain_lengths), assistant=bool(args.assistant),
                         early_exit=args.early_exit_layer is not None)
    prompt_sets = args.prompts.split(",")
    for name in prompt_sets:
        load_prompt_set(name, limit=1)  # a missing file or an unknown set name fails here
    out = prepare_out_dir(args.out)
    target, tok, (drafter, label) = _models(args)
    assistant = None
    if args.assistant:
        from transformers import AutoModelForCausalLM

        from .devices import input_device

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=target.dtype,
                                                         device_map=input_device(target)).eval()
    modes = standard_modes(drafter, assistant, tuple(args.chain_lengths), args.early_exit_layer)
    if keep is not None:
        modes = [m for m in modes if m.name in keep or m.name == "plain"]
    modes += [custom_mode(name, kwargs, drafter) for name, kwargs in own]
    if args.batch_size > 1:  # transformers' assisted modes decode one sequence
        single = [m.name for m in modes if m.name != "plain" and not m.uses_drafter]
        if single:
            print(f"note: {', '.join(single)} cannot run batched in transformers; left out at --batch-size {args.batch_size}")
        modes = [m for m in modes if m.name == "plain" or m.uses_drafter]
    results = run_benchmark(
        target, tok, modes, prompt_sets, args.max_new_tokens, args.limit, args.temperature, args.repeats,
        batch_size=args.batch_size,
        on_set=lambda so_far: write_results({**so_far, "drafter": label}, out),  # each set's, as it ends
    )
    results["drafter"] = label
    write_results(results, out)
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
    from .tools.diagnose import DiagnoseSettings, diagnose

    settings = DiagnoseSettings(  # bad settings fail here, before the models load
        prompts=args.prompts, limit=args.limit, conditions=args.conditions, depth=args.depth,
        max_new_tokens=args.max_new_tokens, sink_tokens=args.sink_tokens,
        long_context_tokens=args.long_context_tokens, system_mode=args.system_prompts,
    ).validate()
    others = [(name, _drafter_before_target(name)) for name in args.compare]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    target, tok, (drafter, label) = _models(args)
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
    for name, early in others:
        other, other_label = early or load_drafter(name, target)
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


def cmd_serve(args) -> int:
    _check_draft_length(args)
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in 0..65535.")
    from .hf.serving import serve  # (an ImportError naming the serve extra, before any model loads)

    if args.drafter == "none":
        check_target_name(args.target)
        (target, tok), drafter, label = _target(args), None, "none (plain decoding)"
    else:
        target, tok, (drafter, label) = _models(args)
    options = {"num_assistant_tokens": args.num_draft_tokens, "draft_sources": args.draft_sources}
    name = args.served_model_name or args.target
    print(f"[drafter: {label}] serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    serve(target, tok, drafter, name=name, host=args.host, port=args.port,
          draft_options={k: v for k, v in options.items() if v is not None and drafter is not None},
          log_level="info" if args.verbose else "warning")
    return 0


def cmd_demo(args) -> int:
    import runpy

    app = Path(__file__).resolve().parents[1] / "demo" / "app.py"
    if not app.is_file():
        print("The demo lives in the repository's demo/ folder; run it from a clone: python demo/app.py", file=sys.stderr)
        return 2
    sys.argv = [str(app), *args.demo_args]  # demo/app.py parses them (`python demo/app.py --help`)
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

    s = sub.add_parser("serve", formatter_class=fmt,
                       help="an OpenAI-compatible server (transformers' own) whose every request speculates")
    s.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct, offline) or a Hub id / folder")
    s.add_argument("--drafter", default="default",
                   help="'default' (the shipped drafter), 'random', a folder, a Hub id, or 'none' (plain decoding)")
    s.add_argument("--num-draft-tokens", type=int, default=None,
                   help="a fixed chain length (transformers' num_assistant_tokens); default: the adaptive schedule")
    s.add_argument("--draft-sources", default="auto", choices=["auto", "eagle", "copy", "eagle+copy"],
                   help="who drafts: the drafter, copies from the prompt and output, or both (auto: both in tree mode)")
    s.add_argument("--served-model-name", default=None, help="the model name requests give (default: --target)%(default).0s")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="the port to listen on")
    add_device_arguments(s)
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", add_help=False,
                       help="the Gradio demo (demo/app.py); its options (--target, --drafter, --device, --port, "
                            "...; see eagle-hf demo --help) are passed on")
    d.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments for demo/app.py (see its --help)")
    d.set_defaults(func=cmd_demo)

    from .training.cli import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":  # (argparse leaves the demo's options out of REMAINDER when they come first)
        args.demo_args = [*extra, *args.demo_args]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if hasattr(args, "device_map"):  # a command that loads a target: bad device options fail before any loading
        error = _check_target_options(args)
        if error:
            print(f"eagle-hf {args.command}: {error}", file=sys.stderr)
            return 2
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if args.verbose:
            traceback.print_exc()
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"eagle-hf {args.command}: {message}" + ("" if args.verbose else " (-v: the traceback)"),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
