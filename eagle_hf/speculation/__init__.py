"""The speculation round, free of transformers: settings, draft trees, drafting, copying, verification, the
round's record and timings, the schedule (acceptance, costs, retries, a batch's budget), the `Speculator`.

Nothing here imports transformers or `eagle_hf.hf`: the loops that verify (transformers' assisted loop, eagle_hf's
tree loop) live in `eagle_hf.hf` and call in.
"""
