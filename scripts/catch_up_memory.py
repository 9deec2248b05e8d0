"""Peak CPU allocation (torch's allocator, from the profiler's memory events) of one generate() call over a long
prompt: plain, and EAGLE tree with the drafter's prompt catch-up in one pass or in chunks of 1,024 rows
(`CATCH_UP_CHUNK`, eagle_hf/speculation/drafting.py). A random Llama (4 layers) in bf16, one thread.

    python scripts/catch_up_memory.py HIDDEN INTERMEDIATE CONTEXT      # e.g. 1024 4096 4096 (about a minute)
"""
import json
import os
import sys
import tempfile

import torch
import transformers as tf

import eagle_hf  # noqa: F401  (installs the generate() hooks)
from eagle_hf import EagleDrafter
from eagle_hf.speculation import drafting

torch.set_num_threads(1)
H, L, I, V, CTX = int(sys.argv[1]), 4, int(sys.argv[2]), 32000, int(sys.argv[3])
torch.manual_seed(0)
t = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384, pad_token_id=0)).to(torch.bfloat16).eval()
t.generation_config.pad_token_id = 0
d = EagleDrafter.for_target(t).to(torch.bfloat16).eval()
ids = torch.randint(1, V, (1, CTX))

def peak(**kw):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
        t.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, **kw)
    fd, f = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    p.export_chrome_trace(f)
    with open(f) as fh:
        ev = json.load(fh)["traceEvents"]
    os.remove(f)
    tot = [e["args"]["Total Allocated"] for e in ev if e.get("name") == "[memory]"]
    return (max(tot) - tot[0]) / 2**20 if tot else float("nan")

tree = dict(assistant_model=d, draft_mode="tree", num_assistant_tokens_schedule="constant", draft_sources="eagle")
peak(); peak(**tree)  # warm-up
res = {"plain": peak()}
drafting.CATCH_UP_CHUNK = 10**9
res["tree, one pass"] = peak(**tree)
drafting.CATCH_UP_CHUNK = 1024
res["tree, chunks of 1024"] = peak(**tree)
print(json.dumps({k: round(v, 1) for k, v in res.items()}), "MiB above the start; H", H, "I", I, "ctx", CTX)
