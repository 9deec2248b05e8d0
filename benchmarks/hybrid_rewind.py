"""What undoing a rejected draft costs on a hybrid target, against a plain decoding step.

eagle_hf's loop copies a hybrid target's recurrent states before each verify and, where a round keeps fewer tokens
than it verified, restores them and replays the kept tokens (`eagle_hf.hf.recurrent`). This times each part on
random Qwen3-Next-style targets in float32, one thread, over a 64-token context: a plain step (one token over
the cache), the verify forward of a chain of 5 (6 tokens), the snapshot, the restore and the replay of 3 kept
tokens; the rewind of a rejected round is snapshot + restore + replay. Medians of `--repeats` runs, each part
timed alone.

    .venv/bin/python benchmarks/hybrid_rewind.py
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_zoo import tiny_model
from eagle_hf.hf.recurrent import Snapshot, recurrent_layers
from eagle_hf.hf.version import cache_kwarg, output_cache

CONTEXT, CHAIN, KEPT = 64, 5, 3
#: the targets: name -> (model type, config fields besides the zoo's tiny ones)
TARGETS = {
    "tiny Qwen3-Next (hidden 64, 4 layers)": ("qwen3_next", {}),
    "Qwen3-Next, hidden 256, 4 layers": ("qwen3_next", {"hidden_size": 256, "intermediate_size": 512,
                                                        "linear_num_value_heads": 8, "linear_num_key_heads": 4,
                                                        "linear_key_head_dim": 32, "linear_value_head_dim": 32}),
}


def build(model_type: str, fields: dict):
    model = tiny_model(model_type)
    if not fields:
        return model
    config = copy.deepcopy(model.config)
    for k, v in fields.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return type(model)(config).eval()


def median_ms(run, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        state = setup() if setup else None
        start = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@torch.no_grad()
def measure(model, repeats: int) -> dict[str, float]:
    ids = torch.randint(1, 500, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    base = output_cache(model(input_ids=ids, use_cache=True))
    fed = torch.randint(1, 500, (1, CHAIN + 1), generator=torch.Generator().manual_seed(1))

    def fresh():
        return copy.deepcopy(base)

    def forward(cache, tokens):
        n = tokens.shape[1]
        model(input_ids=tokens, position_ids=torch.arange(CONTEXT, CONTEXT + n)[None], use_cache=True,
              logits_to_keep=1, **cache_kwarg(cache))

    out = {
        "plain step": median_ms(lambda c: forward(c, fed[:, :1]), repeats, fresh),
        f"verify of {CHAIN + 1} tokens": median_ms(lambda c: forward(c, fed), repeats, fresh),
        "snapshot": median_ms(lambda c: Snapshot(c), repeats, fresh),
    }
    out["restore"] = median_ms(lambda s: s.restore(), repeats, lambda: Snapshot(fresh()))
    out[f"replay of {KEPT} tokens"] = median_ms(lambda c: forward(c, fed[:, :KEPT]), repeats, fresh)
    out["rewind (snapshot + restore + replay)"] = out["snapshot"] + out["restore"] + out[f"replay of {KEPT} tokens"]
    state = sum(t.numel() * t.element_size() for layer in recurrent_layers(base)
                for states in (layer.conv_states, layer.recurrent_states) for t in states.values() if t is not None)
    out["recurrent state (KiB)"] = state / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread, float32")
    for name, (model_type, fields) in TARGETS.items():
        figures = measure(build(model_type, fields), args.repeats)
        step = figures["plain step"]
        print(f"\n{name}")
        print("| part | ms | plain steps |\n|---|---|---|")
        for part, ms in figures.items():
            if part.endswith("(KiB)"):
                print(f"| {part} | {ms:.0f} | |")
            else:
                print(f"| {part} | {ms:.2f} | {ms / step:.2f} |")


if __name__ == "__main__":
    main()
