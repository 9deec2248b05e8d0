"""Is the default mode the best of its sources on every prompt set? (issue 35)

Reads `eagle-hf bench` results (one results.json per process, each with --repeats 2 or more, the modes
"prompt-lookup,copy alone,eagle alone,eagle default") and writes the noise-aware comparison of
`eagle_hf.tools.best_of_sources`: A/A band, best single source chosen on one repeat and scored on the others, the
default's medians per process, per-prompt ratios, the worst prompts with what each source drafted.

    EAGLE_HF_COST_CACHE=off eagle-hf bench --prompts translation,rag --limit 20 --max-new-tokens 128 --repeats 2 \\
        --modes "prompt-lookup,copy alone,eagle alone,eagle default" --out /tmp/run1    # twice: /tmp/run1, /tmp/run2
    python benchmarks/best_of_sources.py /tmp/run1/results.json /tmp/run2/results.json \\
        --out docs/results/x/comparison.md

With --spread (several processes of the same code): how far apart two processes' medians land by chance, per mode
(`eagle_hf.tools.best_of_sources.process_spread`).
"""

import argparse

from eagle_hf.tools.best_of_sources import compare_files, process_spread, read_run, spread_markdown

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of each process (several per process: comma-separated)")
    parser.add_argument("--out", help="where to write the markdown table (a .json copy goes beside it)")
    parser.add_argument("--spread", action="store_true",
                        help="several processes of the same code: the spread of their medians, per mode")
    args = parser.parse_args()
    if args.spread:
        print(spread_markdown(process_spread([read_run(p) for p in args.results])))
    else:
        print(compare_files(args.results, args.out))
